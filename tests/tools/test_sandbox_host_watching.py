"""Sandbox, third round (issue 34): watching the host's reads, and the host's cgroup path.

Before, a run could watch the exposed host files (the interpreter, the venv) with fanotify (unprivileged
since Linux 5.13) and dnotify (`fcntl(F_NOTIFY)`): it saw the host read them, and two concurrent runs passed
data through access events. And `/proc/self/cgroup` showed the host's cgroup path (no cgroup namespace).
Every run here is bounded by the sandbox's own timeout."""

import os
import threading
import time

import pytest

from SimpleTorchLLMRL.tools.sandbox import PythonSandbox


def _seccomp_machine() -> bool:
    from SimpleTorchLLMRL.tools.linux import seccomp_program

    return seccomp_program(os.uname().machine) is not None


needs_filter = pytest.mark.skipif(not _seccomp_machine(),
                                  reason="the seccomp filter lists x86_64 and aarch64 syscall numbers")

FANOTIFY = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": (300, 301), "aarch64": (262, 263)}[os.uname().machine]
fd = libc.syscall(nr[0], 0x200, os.O_RDONLY)  # fanotify_init(FAN_CLASS_NOTIF | FAN_REPORT_FID): unprivileged
print("init", fd, ctypes.get_errno())
ctypes.set_errno(0)
FAN_ACCESS, FAN_OPEN, FAN_EVENT_ON_CHILD = 0x1, 0x20, 0x08000000
r = libc.syscall(nr[1], max(fd, 0), 1, ctypes.c_uint64(FAN_ACCESS | FAN_OPEN | FAN_EVENT_ON_CHILD), -100,
                 sys.prefix.encode())  # fanotify_mark(fd, FAN_MARK_ADD, mask, AT_FDCWD, the venv)
print("mark", r, ctypes.get_errno())
'''


@needs_filter
def test_a_run_cannot_use_fanotify():
    """Before, fanotify_init returned a descriptor and a mark on the venv saw the host's reads of it."""
    result = PythonSandbox(timeout=10).run(FANOTIFY)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines.get("init", "").split() == ["-1", "1"], result.stdout + result.stderr  # EPERM
    assert lines["mark"].split() == ["-1", "1"], result.stdout + result.stderr


DNOTIFY = r'''
import fcntl, os, sys
fd = os.open(sys.prefix, os.O_RDONLY | os.O_DIRECTORY)
try:
    fcntl.fcntl(fd, fcntl.F_NOTIFY, fcntl.DN_ACCESS | fcntl.DN_MULTISHOT)
    print("dnotify ok")
except OSError as e:
    print("dnotify", e.errno)
'''


@needs_filter
def test_a_run_cannot_use_dnotify():
    """Before, fcntl(F_NOTIFY, DN_ACCESS | DN_MULTISHOT) on the venv's directory signalled each host read."""
    result = PythonSandbox(timeout=10).run(DNOTIFY)
    assert result.stdout.split() == ["dnotify", "1"], result.stdout + result.stderr  # EPERM


ORDINARY_FCNTL = r'''
import fcntl, os, struct
r, w = os.pipe()
flags = fcntl.fcntl(r, fcntl.F_GETFL)
fcntl.fcntl(r, fcntl.F_SETFL, flags | os.O_NONBLOCK)
print("getfl", fcntl.fcntl(r, fcntl.F_GETFL) & os.O_NONBLOCK == os.O_NONBLOCK)
fcntl.fcntl(w, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
print("setfd", fcntl.fcntl(w, fcntl.F_GETFD) == fcntl.FD_CLOEXEC)
print("dupfd", fcntl.fcntl(r, fcntl.F_DUPFD_CLOEXEC, 20) >= 20)
print("pipesz", fcntl.fcntl(r, fcntl.F_GETPIPE_SZ) > 0)
fd = os.open("lockme", os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # F_SETLK
fcntl.lockf(fd, fcntl.LOCK_UN)
ofd = struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0)
fcntl.fcntl(fd, fcntl.F_OFD_SETLK, ofd)
print("locks", True)
print("getfd", fcntl.fcntl(fd, fcntl.F_GETFD) >= 0)
'''


def test_ordinary_fcntl_still_works():
    result = PythonSandbox(timeout=10).run(ORDINARY_FCNTL)
    assert result.ok, result.stdout + result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert set(lines) == {"getfl", "setfd", "dupfd", "pipesz", "locks", "getfd"}, result.stdout
    assert all(v == "True" for v in lines.values()), result.stdout


CGROUP = r'''
import os
print(open("/proc/self/cgroup").read(), end="")
print(open("/proc/1/cgroup").read(), end="")
print("ns", os.readlink("/proc/self/ns/cgroup"))
'''


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/cgroup"), reason="this kernel has no cgroup namespaces")
def test_a_run_does_not_see_the_hosts_cgroup_path():
    """Before, /proc/self/cgroup in a run read e.g. `4:memory:/<host's cgroup>/stlr-sandbox-<id>`."""
    with open("/proc/self/cgroup") as f:
        host_paths = {line.split(":", 2)[2] for line in f.read().splitlines()} - {"/"}
    result = PythonSandbox(timeout=10, isolation="namespaces").run(CGROUP)
    if result.error and "namespaces are unavailable" in result.error:
        pytest.skip(result.error)  # the process fallback shares the host's /proc
    assert result.ok, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    ns = [line for line in lines if line.startswith("ns ")]
    assert ns and ns[0].split()[1] != os.readlink("/proc/self/ns/cgroup"), result.stdout  # a namespace of its own
    seen = [line.split(":", 2)[2] for line in lines if not line.startswith("ns ")]
    assert seen, result.stdout
    for path in host_paths:
        assert path not in result.stdout, result.stdout
    assert all(p == "/" for p in seen), result.stdout  # the run's cgroup is the namespace's root
    assert "stlr-sandbox" not in result.stdout


SENDER = r'''
import os, sys, time
time.sleep(1.0)
for bit in range(12):  # 12 reads of an exposed file, each one a potential access event elsewhere
    with open(os.path.join(sys.prefix, "pyvenv.cfg"), "rb") as f:
        f.read()
    time.sleep(0.05)
print("sent")
'''
WATCHER = r'''
import ctypes, fcntl, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 300, "aarch64": 262}[os.uname().machine]
fan = libc.syscall(nr, 0x200 | 0x2, os.O_RDONLY)  # FAN_REPORT_FID | FAN_NONBLOCK
print("fanotify", "fd" if fan >= 0 else ctypes.get_errno())
if fan >= 0:
    libc.syscall(nr + 1, fan, 1, ctypes.c_uint64(0x1 | 0x20 | 0x08000000), -100, sys.prefix.encode())
count = [0]
signal.signal(signal.SIGIO, lambda *a: count.__setitem__(0, count[0] + 1))
d = os.open(sys.prefix, os.O_RDONLY | os.O_DIRECTORY)
try:
    fcntl.fcntl(d, fcntl.F_NOTIFY, fcntl.DN_ACCESS | fcntl.DN_MULTISHOT)
    print("dnotify", "watching")
except OSError as e:
    print("dnotify", e.errno)
events, end = 0, time.monotonic() + 2.5
while time.monotonic() < end:
    if fan >= 0:
        try:
            data = os.read(fan, 65536)
            while data:  # each event: fanotify_event_metadata (event_len first), then its file handle
                events += 1
                data = data[int.from_bytes(data[:4], sys.byteorder):]
        except BlockingIOError:
            pass
    time.sleep(0.02)
print("events", events + count[0])
'''


@needs_filter
def test_two_runs_pass_no_data_through_access_events():
    """Before, a run reading an exposed file 12 times was counted 12 times by a concurrent run's watch."""
    box = PythonSandbox(timeout=10)
    out = {}
    watcher = threading.Thread(target=lambda: out.__setitem__("watch", box.run(WATCHER)))
    watcher.start()
    time.sleep(0.2)
    out["send"] = box.run(SENDER)
    watcher.join(20)
    assert out["send"].stdout.strip() == "sent", out["send"].stdout + out["send"].stderr
    lines = dict(line.split(" ", 1) for line in out["watch"].stdout.splitlines())
    assert lines.get("fanotify") == "1" and lines.get("dnotify") == "1", out["watch"].stdout + out["watch"].stderr
    assert lines["events"] == "0", out["watch"].stdout


def test_the_filter_refuses_watches_and_lets_other_fcntl_through():
    """The BPF program itself, interpreted here, on every machine: args[1] of fcntl is at offset 24."""
    from SimpleTorchLLMRL.tools.linux import seccomp_program

    def verdict(machine, arch, nr, args=(0, 0)):
        prog = seccomp_program(machine)
        pc, acc = 0, 0
        while True:
            code, jt, jf, k = prog[pc]
            if code == 0x20:
                acc, pc = {4: arch, 0: nr, 16: args[0], 24: args[1]}[k], pc + 1
            elif code in (0x15, 0x35):
                pc += 1 + (jt if (acc == k if code == 0x15 else acc >= k) else jf)
            else:
                return k

    allow, eperm = 0x7FFF0000, 0x50000 | 1
    for machine, arch, (fan_init, fan_mark, fcntl_nr) in (("x86_64", 0xC000003E, (300, 301, 72)),
                                                         ("aarch64", 0xC00000B7, (262, 263, 25))):
        assert verdict(machine, arch, fan_init) == verdict(machine, arch, fan_mark) == eperm
        assert verdict(machine, arch, fcntl_nr, (3, 1026)) == eperm  # F_NOTIFY
        for cmd in (0, 1, 2, 3, 4, 5, 6, 7, 36, 37, 38, 1030, 1031, 1032, 1033, 1025, 1024):
            assert verdict(machine, arch, fcntl_nr, (3, cmd)) == allow, cmd  # F_DUPFD .. F_GETPIPE_SZ, leases
        assert verdict(machine, arch, 0) == allow
