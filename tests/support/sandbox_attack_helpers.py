"""Helpers that keep the sandbox attack tests bounded: outer timeouts, and clean-up of every process by PID.

Each attack names its processes with a unique marker (prctl PR_SET_NAME, inherited by
children and threads), so the test can find what survived a run from the outside,
whatever PID namespace it lives in, and SIGKILL exactly those PIDs afterwards.
"""

import os
import secrets
import signal
import threading
import time

SYS_EXIT = {"x86_64": 60, "aarch64": 93}.get(os.uname().machine)


def new_marker() -> str:
    return "stlr" + secrets.token_hex(4)  # 12 characters: fits the 15 of a task's comm


def name_code(marker: str) -> str:
    """Python source that names the calling process `marker` (its children and threads inherit it)."""
    return f"import ctypes as _c\n_c.CDLL(None).prctl(15, b'{marker}', 0, 0, 0)\n"


def _tasks(pid: str) -> list[tuple[str, str]]:
    """(comm, state) of each thread of process `pid`; [] when it is gone."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            comm = stat[stat.index("(") + 1: stat.rindex(")")]
            out.append((comm, stat[stat.rindex(")") + 2]))
    except (OSError, ValueError):
        pass
    return out


def survivors(marker: str) -> list[int]:
    """PIDs (outer namespace) of processes with a live thread named `marker` (zombie leaders included)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and any(c == marker and s not in "ZX" for c, s in _tasks(pid)):
            found.append(int(pid))
    return found


def kill_survivors(marker: str, rounds: int = 20) -> list[int]:
    """SIGKILL what `survivors` finds, by PID, until nothing is left; returns every PID it killed."""
    killed = []
    for _ in range(rounds):
        pids = survivors(marker)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
        time.sleep(0.05)
    return killed


def bounded(fn, limit: float):
    """(result, seconds) of fn() run in a thread; raises TimeoutError when it is not back within `limit`."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    start = time.monotonic()
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        raise TimeoutError(f"the call did not return within the outer timeout of {limit} s")
    if "error" in box:
        raise box["error"]
    return box["value"], time.monotonic() - start
