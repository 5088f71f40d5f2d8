"""Run model-written Python in a separate, confined process.

    box = PythonSandbox(timeout=5)
    result = box.run("print(sum(range(10)))")
    result.stdout, result.exit_code, result.timed_out, result.truncated   # '45\\n', 0, False, False
    python = python_tool(box)                                           # the same as a Tool

isolation="namespaces" (the default where allowed: own namespaces and root, one init that takes the whole run
with it) or "process" (the fallback, with a warning); always rlimits, seccomp, Landlock where present, an
unprivileged uid as root, a wall-clock timeout. docs/sandbox.md has the guarantees and the attacks.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from SimpleTorchLLMRL.tools.base import Tool
from SimpleTorchLLMRL.tools.landlock import abi_version as landlock_abi
from SimpleTorchLLMRL.tools.sandbox_run import Spec, finish, start, watch
from SimpleTorchLLMRL.utils.warn import warn_user

_FALLBACK_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
_NOBODY = 65534
_FRESH_UID_BASE, _FRESH_UID_SPAN = 1_500_000_000, 400_000_000
_ISOLATIONS = ("auto", "namespaces", "process")
_SECRET_LIMIT = 4096
_namespaces_unsupported: dict[bool, str] = {}  # euid == 0 -> why namespaces failed here


@dataclass
class SandboxResult:
    """What a run produced. exit_code < 0 means killed by that signal; None if it never started."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0
    error: str | None = None
    timeout: float | None = None
    output_limit: int | None = None
    report: bytes = b""  # what the program wrote to fd 4, when run with a secret (see PythonSandbox.run)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.error is None

    def to_text(self) -> str:
        """The message text for the model: output, then what went wrong, if anything."""
        parts = []
        if self.stdout.strip():
            parts.append(self.stdout.rstrip())
        if self.stderr.strip():
            parts.append("[stderr]\n" + self.stderr.rstrip())
        if self.truncated:
            parts.append(f"[output truncated to {self.output_limit} bytes per stream]")
        if self.error is not None:
            parts.append(f"[sandbox error: {self.error}]")
        elif self.timed_out:
            parts.append(f"[timed out after {self.timeout:g} s]")
        elif self.exit_code is not None and self.exit_code < 0:
            sig = signal.Signals(-self.exit_code) if -self.exit_code in signal.valid_signals() else -self.exit_code
            why = {signal.SIGXCPU: " (CPU time limit)", signal.SIGKILL: " (killed)"}.get(sig, "")
            parts.append(f"[terminated by signal {getattr(sig, 'name', sig)}{why}]")
        elif self.exit_code not in (0, None):
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"


@dataclass
class PythonSandbox:
    """Limits for running untrusted Python (see the module docstring).

    timeout:          wall-clock seconds before the whole run is killed
    cpu_seconds:      CPU-time limit per process (default: ceil(timeout) + 1)
    memory_mb:        address-space limit per process (RLIMIT_AS); as root with a cgroup, of the whole run
    file_size_mb:     largest file the code may write (RLIMIT_FSIZE)
    max_processes:    processes and threads of the run (RLIMIT_NPROC of its uid; as root also a cgroup)
    max_open_files:   RLIMIT_NOFILE
    max_output_bytes: bytes kept of stdout and of stderr each
    run_as:           "auto" (as root: a fresh unprivileged uid per run), a uid, or None (never drop)
    python:           the interpreter (default sys.executable; else the first system python3 the run can start)
    confine_writes:   use Landlock, where available, to allow writes only in the working directory
    allow_network:    keep the caller's network (no network namespace; no Landlock TCP rule)
    isolation:        "auto" (namespaces where the kernel allows, else "process" with a warning),
                      "namespaces" (an error result where unavailable) or "process"
    """

    timeout: float = 10.0
    cpu_seconds: int | None = None
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_processes: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 16_000
    max_code_chars: int = 100_000
    run_as: str | int | None = "auto"
    python: str | None = None
    confine_writes: bool = True
    allow_network: bool = False
    isolation: str = "auto"

    def __post_init__(self):
        if not self.timeout > 0:
            raise ValueError(f"PythonSandbox timeout must be > 0 seconds, got {self.timeout!r}")
        for name in ("memory_mb", "file_size_mb", "max_processes", "max_open_files", "max_output_bytes",
                     "max_code_chars"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"PythonSandbox {name} must be an int >= 1, got {v!r}")
        if self.cpu_seconds is not None and not (isinstance(self.cpu_seconds, int) and self.cpu_seconds >= 1):
            raise ValueError(f"PythonSandbox cpu_seconds must be an int >= 1 or None, got {self.cpu_seconds!r}")
        if not (self.run_as in ("auto", None) or (isinstance(self.run_as, int) and self.run_as > 0)):
            raise ValueError(f"PythonSandbox run_as must be 'auto', None or a uid > 0, got {self.run_as!r}")
        if self.isolation not in _ISOLATIONS:
            raise ValueError(f"PythonSandbox isolation must be one of {_ISOLATIONS}, got {self.isolation!r}")

    # ---- identity, interpreter, isolation ---------------------------------------------------------------
    def _identity(self) -> tuple[int | None, int | None, bool]:
        """(uid, gid, fresh): the identity to drop to, or (None, None, False) when not dropping."""
        if self.run_as is None or os.geteuid() != 0:
            return None, None, False
        if self.run_as == "auto":
            if _fresh_uids_work():
                uid = _FRESH_UID_BASE + secrets.randbelow(_FRESH_UID_SPAN)
                return uid, uid, True
            return _NOBODY, _NOBODY, False
        return self.run_as, self.run_as, False

    def _rlimits(self) -> dict[str, int]:
        mb = 1 << 20
        return {
            "RLIMIT_CORE": 0,
            "RLIMIT_CPU": (self.cpu_seconds or math.ceil(self.timeout) + 1) + 1,  # soft = this - 1 -> SIGXCPU
            "RLIMIT_AS": self.memory_mb * mb,
            "RLIMIT_FSIZE": self.file_size_mb * mb,
            "RLIMIT_NPROC": self.max_processes,
            "RLIMIT_NOFILE": self.max_open_files,
        }

    def _isolation(self) -> str:
        if self.isolation != "auto":
            return self.isolation
        return "process" if (os.geteuid() == 0) in _namespaces_unsupported else "namespaces"

    def interpreter(self) -> str:
        """The interpreter runs use: the configured one if the sandboxed uid can start it, else a fallback."""
        wanted = self.python or sys.executable
        wanted = shutil.which(wanted) or wanted
        uid, _, _ = self._identity()
        if uid is None:
            return wanted
        return _usable_interpreter(self, wanted)

    def _shared_uid(self) -> int | None:
        """The uid runs of this sandbox share (a fixed run_as, or nobody when fresh uids do not work), else None."""
        uid, _, fresh = self._identity()
        return None if fresh else uid

    # ---- running --------------------------------------------------------------------------------------
    def run(self, code: str, *, secret: bytes | None = None, report_limit: int = 4096) -> SandboxResult:
        """Run `code` under the limits; never raises for anything the code does.

        secret: bytes the program (and only it) can read once from fd 3; what it writes to fd 4
        (its first `report_limit` bytes) comes back as `result.report`. CodeEnv's harness reports on it.
        """
        if not isinstance(code, str):
            raise TypeError(f"PythonSandbox.run takes source code as a str, got {type(code).__name__}")
        if secret is not None and not (isinstance(secret, bytes) and len(secret) <= _SECRET_LIMIT):
            raise ValueError(f"PythonSandbox.run secret must be bytes of at most {_SECRET_LIMIT}, got {secret!r:.40}")
        if isinstance(report_limit, bool) or not isinstance(report_limit, int) or report_limit < 1:
            raise ValueError(f"PythonSandbox.run report_limit must be an int >= 1, got {report_limit!r}")
        if len(code) > self.max_code_chars or "\x00" in code:
            why = "contains a NUL byte" if "\x00" in code else f"is over {self.max_code_chars} characters"
            return SandboxResult("", "", None, error=f"the code {why}", timeout=self.timeout)
        began = time.monotonic()
        try:
            with _one_run_per_uid(self._shared_uid()):
                return self._run(code, self.interpreter(), secret, report_limit)
        except Exception as e:  # a failure of the sandbox itself: reported to the caller, never raised
            return SandboxResult("", "", None, error=f"sandbox failure: {type(e).__name__}: {e}",
                                 seconds=time.monotonic() - began, timeout=self.timeout)

    def _run(self, code: str, python: str, secret: bytes | None = None, report_limit: int = 4096) -> SandboxResult:
        isolation = self._isolation()
        result, unsupported = self._run_isolated(code, python, secret, isolation, report_limit)
        if unsupported is not None:
            _namespaces_unsupported[os.geteuid() == 0] = unsupported
            if self.isolation == "namespaces":
                return result
            warn_user(f"PythonSandbox: namespaces are unavailable here ({unsupported}); falling back to "
                      "isolation='process', which contains less (see docs/sandbox.md)", RuntimeWarning)
            result, _ = self._run_isolated(code, python, secret, "process", report_limit)
        return result

    def _run_isolated(self, code: str, python: str, secret: bytes | None, isolation: str,
                      report_limit: int = 4096) -> tuple[SandboxResult, str | None]:
        uid, gid, fresh = self._identity()
        began = time.monotonic()
        spec = Spec(code, python, isolation, self._rlimits(), uid, gid, fresh, self.memory_mb << 20,
                    self.max_processes, self.allow_network, landlock_abi() if self.confine_writes else 0, secret,
                    report_limit)
        try:
            launch = start(spec)
        except (OSError, subprocess.SubprocessError) as e:
            return SandboxResult("", "", None, error=f"could not start the sandbox: {e}",
                                 seconds=time.monotonic() - began, timeout=self.timeout), None
        outcome = None
        try:
            outcome = watch(launch, self.timeout, self.max_output_bytes)
        finally:
            finish(launch, outcome)
        if outcome.unsupported is not None:
            return SandboxResult("", "", None, error=f"namespaces are unavailable: {outcome.unsupported}",
                                 seconds=time.monotonic() - began, timeout=self.timeout), outcome.unsupported
        return SandboxResult(
            outcome.stdout.decode("utf-8", "replace"), outcome.stderr.decode("utf-8", "replace"),
            None if outcome.error else outcome.exit_code, timed_out=outcome.timed_out, truncated=outcome.truncated,
            seconds=time.monotonic() - began, error=outcome.error, timeout=self.timeout,
            output_limit=self.max_output_bytes, report=outcome.report,
        ), None


_probe_lock = threading.Lock()
_probe_cache: dict[tuple, str] = {}


_UID_LOCKS: dict[int, threading.Lock] = {}
_UID_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _one_run_per_uid(uid: int | None):
    """Runs that share a uid run one at a time (threads of this process, and other processes on this machine
    through a root-only lock file the runs cannot see): a uid's process limit and keyring are per uid, so
    concurrent runs would take each other's processes or read each other's keys."""
    if uid is None:
        yield
        return
    with _UID_LOCKS_GUARD:
        lock = _UID_LOCKS.setdefault(uid, threading.Lock())
    with lock:
        path = os.path.join(tempfile.gettempdir(), f".simpletorchllmrl-sandbox-uid-{uid}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


@functools.lru_cache(maxsize=1)
def _fresh_uids_work() -> bool:
    """Can this root process switch to an arbitrary unmapped uid (false in some user namespaces)?"""
    try:
        r = subprocess.run(["/bin/true"], preexec_fn=functools.partial(os.setuid, _FRESH_UID_BASE),
                           timeout=10, capture_output=True)
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _usable_interpreter(box: PythonSandbox, wanted: str) -> str:
    """`wanted` if a sandboxed run of it works, else (with a RuntimeWarning) the first fallback that does."""
    key = (wanted, box.run_as, box._isolation())
    with _probe_lock:
        if key in _probe_cache:
            return _probe_cache[key]
        tried, why = [], ""
        for candidate in (wanted, *_FALLBACK_PYTHONS):
            if candidate in tried or (candidate != wanted and not os.path.exists(candidate)):
                continue
            tried.append(candidate)
            r = box._run("import sys; print(sys.version_info[0])", candidate)
            if r.ok and r.stdout.strip() == "3":
                if candidate != wanted:
                    warn_user(
                        f"PythonSandbox: the sandbox's unprivileged uid cannot run {wanted} ({why}); using "
                        f"{candidate} instead, without the packages of {wanted}. Make it and its directories "
                        "readable by all users (not under a 0700 directory such as /root), use "
                        "isolation='namespaces', or pass python=...", RuntimeWarning)
                _probe_cache[key] = candidate
                return candidate
            why = why or (r.error or r.stderr.strip() or f"exit code {r.exit_code}")[-300:]
        raise RuntimeError(
            f"PythonSandbox: no interpreter among {tried} starts as an unprivileged user ({why!r}). Pass "
            "python='/path/to/python3' readable by all users, or run_as=None to stay root (nothing is then "
            "contained)."
        )


def python_tool(sandbox: PythonSandbox | None = None, name: str = "python") -> Tool:
    """The sandbox as a Tool taking `code` (bound to ```python blocks and <python> tags)."""
    box = sandbox if sandbox is not None else PythonSandbox()

    def python(code: str) -> str:
        """Run Python code in a sandbox and return what it prints (stdout, stderr and errors).

        Args:
            code: Python source code; print() the values you want to see.
        """
        return box.run(code).to_text()

    return Tool(python, name=name, timeout=box.timeout + 10.0)


def run_python(code: str, **limits) -> SandboxResult:
    """One-off: `PythonSandbox(**limits).run(code)`."""
    return PythonSandbox(**limits).run(code)
