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
