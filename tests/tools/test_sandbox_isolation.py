"""Sandbox, second round of attacks: what a run can do to the file that carries its code.

Before, the code reached the run as an unnamed temp file on the host's disk, open read-write on fd 0:
a run could write to it and grow it outside its working directory (bounded only by file_size_mb)."""

import os
import threading
import time

import pytest

from SimpleTorchLLMRL.tools.sandbox import PythonSandbox

PROBE = r'''
import os
print("link", os.readlink("/proc/self/fd/0"))
for how in ("write", "reopen", "truncate"):
    try:
        if how == "write":
            os.write(0, b"x" * 4096)
        elif how == "reopen":
            fd = os.open("/proc/self/fd/0", os.O_RDWR)
            os.write(fd, b"x")
        else:
            os.ftruncate(0, 16 << 20)
        print(how, "succeeded")
    except OSError as e:
        print(how, "refused", e.errno)
'''


def test_the_code_arrives_read_only_and_not_on_the_host_disk():
    result = PythonSandbox(timeout=10).run(PROBE)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["link"].startswith("/memfd:"), result.stdout  # in memory, sealed
    for how in ("write", "reopen", "truncate"):
        assert lines[how].startswith("refused"), result.stdout


def test_code_still_runs_from_the_sealed_file():
    box = PythonSandbox(timeout=10)
    big = "x = 0\n" + "x += 1\n" * 12000 + "print(x)\n"  # 84 kB: more than a pipe buffer holds
    assert box.run(big).stdout.strip() == "12000"
    assert box.run("print('é' + chr(0x1F600))").stdout.strip() == "é" + chr(0x1F600)


HOLD_16 = r'''
import os, time
kids = []
for _ in range(15):  # with this process: 16, the run's max_processes
    pid = os.fork()
    if pid == 0:
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
print("held")
'''
FORK_ONCE = r'''
import os
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print("forked")
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="run_as drops to a uid only when started as root")
def test_runs_that_share_a_fixed_uid_do_not_take_each_others_processes():
    """Before, with run_as fixed, a run holding its 16 processes made a concurrent run's first fork fail
    (BlockingIOError: RLIMIT_NPROC counts the uid's processes). Now such runs take turns."""
    box = PythonSandbox(timeout=20, run_as=43210, max_processes=16)
    out = {}
    first = threading.Thread(target=lambda: out.__setitem__("hold", box.run(HOLD_16)))
    first.start()
    time.sleep(0.5)
    out["fork"] = box.run(FORK_ONCE)
    first.join()
    assert out["hold"].stdout.strip() == "held", out["hold"].stderr
    assert out["fork"].stdout.strip() == "forked", out["fork"].stderr
    assert out["fork"].seconds < 20


def test_runs_with_fresh_uids_still_run_at_once():
    """Only shared uids take turns: two "auto" runs (fresh uids as root) overlap in time."""
    box = PythonSandbox(timeout=20)
    results = []
    threads = [threading.Thread(target=lambda: results.append(box.run("import time; time.sleep(2)")))
               for _ in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and all(r.ok for r in results)
    assert time.monotonic() - t0 < 3.5  # taking turns would need over 4 s


LOCK_VENV = r'''
import fcntl, os, sys, time
fd = os.open(os.path.join(sys.prefix, ".lock"), os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(3)
'''


def test_a_run_cannot_lock_the_hosts_venv_lock_file():
    """Before, a run could flock the venv's `.lock` (bound read-only, opened O_RDONLY): the host's `uv run`
    then waited for the run's whole timeout. Now the run locks an empty file of its own in its place."""
    import fcntl
    import sys

    lock = os.path.join(sys.prefix, ".lock")
    if not os.path.isfile(lock):
        pytest.skip("this interpreter's prefix has no .lock file (not a uv venv)")
    box = PythonSandbox(timeout=10)
    done = {}
    run = threading.Thread(target=lambda: done.__setitem__("r", box.run(LOCK_VENV)))
    run.start()
    time.sleep(1.5)  # the run has started and holds its lock for 3 s
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the host's lock is free
        fcntl.flock(fd, fcntl.LOCK_UN)
        taken = True
    except BlockingIOError:
        taken = False
    finally:
        os.close(fd)
        run.join()
    assert done["r"].stdout.strip() == "locked", done["r"].stderr
    assert taken, "the run held the host's .venv/.lock"


KEYS = r'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
machine = os.uname().machine
add_key = {"x86_64": 248, "aarch64": 217}.get(machine, 248)
r = libc.syscall(add_key, b"user", b"stlr-probe", b"secret", 6, ctypes.c_int(-3))  # KEY_SPEC_USER_KEYRING
print("uid", os.getuid())
print("add_key", r, ctypes.get_errno())
'''


def _seccomp_machine() -> bool:
    from SimpleTorchLLMRL.tools.linux import seccomp_program

    return seccomp_program(os.uname().machine) is not None


@pytest.mark.skipif(not _seccomp_machine(), reason="the seccomp filter lists x86_64 and aarch64 syscall numbers")
def test_no_kernel_key_outlives_a_run():
    """Before, a run could add keys to its uid's user keyring: they stayed in kernel memory after it (and
    /proc/key-users listed the run's uid), and two runs with the same uid could pass data through them.
    Now the keyring syscalls fail with ENOSYS, as in a kernel without keys."""
    result = PythonSandbox(timeout=10).run(KEYS)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["add_key"].split() == ["-1", "38"], result.stdout + result.stderr
    if os.geteuid() == 0 and os.path.exists("/proc/key-users"):
        users = {line.split(":")[0].strip() for line in open("/proc/key-users")}
        assert lines["uid"] not in users or lines["uid"] == "0"


SOCKETS = r'''
import socket
for fam in ("AF_VSOCK", "AF_NETLINK", "AF_PACKET", "AF_ALG", "AF_UNIX", "AF_INET", "AF_INET6"):
    if not hasattr(socket, fam):
        continue
    try:
        socket.socket(getattr(socket, fam), socket.SOCK_DGRAM if fam != "AF_ALG" else socket.SOCK_SEQPACKET).close()
        print(fam, "ok")
    except OSError as e:
        print(fam, e.errno)
a, b = socket.socketpair()
a.send(b"x")
print("socketpair", b.recv(1).decode())
'''


@pytest.mark.skipif(not _seccomp_machine(), reason="the seccomp filter lists x86_64 and aarch64 syscall numbers")
def test_only_unix_and_inet_sockets_can_be_made():
    """Before, a run could make AF_VSOCK sockets, which ignore the network namespace (a port bound there
    was taken on the host). Sockets are only made here, never bound or connected."""
    result = PythonSandbox(timeout=10).run(SOCKETS)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    for fam in ("AF_VSOCK", "AF_NETLINK", "AF_PACKET", "AF_ALG"):
        if fam in lines:
            assert lines[fam] == "97", result.stdout + result.stderr  # EAFNOSUPPORT
    assert lines["AF_UNIX"] == lines["AF_INET"] == lines["AF_INET6"] == "ok", result.stdout + result.stderr
    assert lines["socketpair"] == "x"


def test_the_filter_program_decides_as_documented():
    """The BPF program itself, interpreted here, on every machine."""
    from SimpleTorchLLMRL.tools.linux import seccomp_program

    prog = seccomp_program("x86_64")

    def verdict(arch, nr, arg0):
        pc, acc = 0, 0
        while True:
            code, jt, jf, k = prog[pc]
            if code == 0x20:
                acc, pc = {4: arch, 0: nr, 16: arg0}[k], pc + 1
            elif code in (0x15, 0x35):
                pc += 1 + (jt if (acc == k if code == 0x15 else acc >= k) else jf)
            else:
                return k

    x86, allow = 0xC000003E, 0x7FFF0000
    assert verdict(x86, 0, 0) == allow  # read
    assert verdict(x86, 41, 1) == verdict(x86, 41, 2) == verdict(x86, 41, 10) == allow  # unix, inet, inet6
    assert verdict(x86, 53, 1) == allow  # socketpair(AF_UNIX)
    assert verdict(x86, 41, 40) == verdict(x86, 53, 40) == 0x50000 | 97  # AF_VSOCK: EAFNOSUPPORT
    assert verdict(x86, 248, 0) == verdict(x86, 249, 0) == verdict(x86, 250, 0) == 0x50000 | 38  # keys: ENOSYS
    assert verdict(x86, 253, 0) == verdict(x86, 294, 0) == 0x50000 | 38  # inotify_init(1): ENOSYS
    assert verdict(x86, 0x40000000, 0) == 0x50000 | 38  # x32
    assert verdict(0x40000003, 0, 0) == 0x50000 | 38  # i386
    assert seccomp_program("riscv64") is None


def test_the_runs_init_shows_no_configuration_on_its_command_line():
    """Before, /proc/1/cmdline of a run listed its host working directory, cgroup path, uid and every bind."""
    probe = "print(open('/proc/1/cmdline').read().replace(chr(0), ' '))\nimport os\nprint(os.getuid())"
    result = PythonSandbox(timeout=10).run(probe)
    cmdline, uid = result.stdout.splitlines()[:2]
    assert "config_fd=" in cmdline, result.stdout + result.stderr
    for leak in ("root=", "workdir=", "cgroup=", "uid=", "expose=", "rlimit=", f"={uid}"):
        assert leak not in cmdline, cmdline


INOTIFY = r'''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
print(fd, ctypes.get_errno())
'''


@pytest.mark.skipif(not _seccomp_machine(), reason="the seccomp filter lists x86_64 and aarch64 syscall numbers")
def test_a_run_cannot_watch_the_hosts_files_being_opened():
    """Before, inotify on an exposed host file (the interpreter, site-packages) saw the host open it."""
    result = PythonSandbox(timeout=10).run(INOTIFY)
    assert result.stdout.split() == ["-1", "38"], result.stdout + result.stderr  # ENOSYS
