r"""math-verify in child processes, so that every verdict has a deadline on any thread.

    ask_math_verify(gold, pred, timeout=5.0)  -> True | False | None   (None: no verdict)

math-verify's own SIGALRM works only on the main thread, and some answers (`9^{9^{9}}`) spend minutes in
one C-level operation no signal interrupts. So each question goes to a reused child process
(`math_verify_worker.py`, no torch); one that overruns `timeout` is killed and replaced. POSIX only.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

WORKER_SCRIPT = Path(__file__).with_name("math_verify_worker.py")
STARTUP_TIMEOUT_S = 12.0  # importing sympy + math-verify in a fresh child, on a busy machine


class _Worker:
    """One child process and its half-read output."""

    def __init__(self, command: list[str]):
        # A new session: a Ctrl-C meant for the trainer does not kill its reward workers.
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self.buffer = b""
        self.ready = False

    def read_line(self, deadline: float) -> dict | None:
        """The next JSON line from the child, or None if it died or `deadline` (monotonic) passed."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def ask(self, gold: str, pred: str, timeout: float) -> tuple[bool, bool | None]:
        """(healthy, verdict). Not healthy: the child died, overran or said something else; kill it."""
        if not self.ready:
            hello = self.read_line(time.monotonic() + STARTUP_TIMEOUT_S)
            if not (hello and hello.get("ready")):
                return False, None
            self.ready = True
        deadline = time.monotonic() + timeout
        question = json.dumps({"gold": gold, "pred": pred, "timeout": min(2.0, timeout / 3)}) + "\n"
        try:
            self.proc.stdin.write(question.encode())
            self.proc.stdin.flush()
        except OSError:
            return False, None
        reply = self.read_line(deadline)
        if reply is None or "verdict" not in reply:
            return False, None
        return True, reply["verdict"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class MathVerifyPool:
    """Idle workers, taken by one caller at a time; a caller with none idle starts one.

    command: how to start a worker (default: this Python on `math_verify_worker.py`; -P so that
    the script's folder, which holds reward/math.py, does not shadow the stdlib's math).
    """

    def __init__(self, command: list[str] | None = None):
        self.command = list(command) if command else [sys.executable, "-P", str(WORKER_SCRIPT)]
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._pid = os.getpid()

    def _take(self) -> _Worker:
        with self._lock:
            if self._pid != os.getpid():  # a forked child must not share its parent's pipes
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                return self._idle.pop()
        return _Worker(self.command)

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def ask(self, gold: str, pred: str, timeout: float) -> bool | None:
        worker = self._take()
        healthy, verdict = worker.ask(gold, pred, timeout)
        if healthy:
            self._give_back(worker)
            return verdict
        worker.kill()
        self._give_back(_Worker(self.command))  # its replacement starts importing now, ready for the next call
        return None

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


_POOL: MathVerifyPool | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> MathVerifyPool:
    """The process-wide pool, made (and its cleanup at exit registered) on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = MathVerifyPool()
            atexit.register(_POOL.close)
        return _POOL


def ask_math_verify(gold: str, pred: str, timeout: float = 5.0) -> bool | None:
    r"""math-verify's verdict on `\boxed{pred}` against `\boxed{gold}` within `timeout` seconds.

    True / False: its verdict. None: no verdict (it could not read an answer, or it ran
    past the deadline and its process was killed).
    """
    return _pool().ask(gold, pred, timeout)
