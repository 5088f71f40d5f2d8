"""Run model-written Python in a separate, confined process.

    box = PythonSandbox(timeout=5)
    result = box.run("print(sum(range(10)))")
    result.stdout, result.exit_code, result.timed_out, result.truncated   # '45\\n', 0, False, False
    result.to_text()                                                    # what the model is shown
    python = python_tool(box)                                           # the same as a Tool

What confines the code (each layer on its own; together they contain the cases the
tests run: infinite loop, memory bomb, fork bomb, 100 MB print, writes outside the
working directory, reading the parent's environment):

- `sys.executable -I -c code`: isolated mode, no PYTHON* variables, no user site;
- a scrubbed environment (PATH, LANG, HOME and TMPDIR only) and an empty temporary
  working directory, deleted afterwards;
- resource limits set in the child before exec: CPU seconds, address space, file
  size, process count, open files, no core dumps;
- when the parent runs as root (RLIMIT_NPROC does not apply to root): a fresh,
  unprivileged uid/gid per run (or `run_as=` a fixed one), so the process limit
  holds, root-owned files and other processes' /proc entries are out of reach, and
  every process left with that uid is killed afterwards;
- Landlock, where the kernel has it: writes only inside the working directory, no
  TCP connect/bind (unless `allow_network=True`), no signals to outside processes;
- a wall-clock timeout that kills the whole process group, and output read with a
  cap while the child runs (the rest is read and dropped, never buffered).

Limits of this design: without root the sandbox shares the caller's uid, so the
parent's /proc/<pid>/environ stays readable and a child that calls setsid() can
outlive the run (until its CPU limit); without Landlock, world-writable
directories such as /tmp stay writable. Use a container for hostile code at scale.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import SimpleTorchLLMRL.tools.landlock as landlock
from SimpleTorchLLMRL.tools.base import Tool

_FALLBACK_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
_NOBODY = 65534
_FRESH_UID_BASE, _FRESH_UID_SPAN = 1_500_000_000, 400_000_000


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


def _cap(limit: int, value: int) -> tuple[int, int]:
    """(soft, hard) = value, but never above the current hard limit (which only root may raise)."""
    soft, hard = resource.getrlimit(limit)
    v = value if hard == resource.RLIM_INFINITY else min(value, hard)
    return v, v


def _child_setup(limits: dict[int, int], uid: int | None, gid: int | None, workdir: str,
                 confine: bool, allow_network: bool, abi: int) -> None:
    """preexec_fn: runs in the forked child before exec (only syscalls, modules imported already)."""
    for limit, value in limits.items():
        if limit == resource.RLIMIT_CPU:  # soft -> SIGXCPU, hard one second later -> SIGKILL
            soft, hard = _cap(limit, value + 1)
            resource.setrlimit(limit, (max(1, soft - 1), hard))
        else:
            resource.setrlimit(limit, _cap(limit, value))
    if confine:
        landlock.restrict_writes(workdir, allow_network=allow_network, abi=abi)
    if uid is not None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)


def _kill_uid(uid: int, rounds: int = 50) -> None:
    """SIGKILL every process whose real uid is `uid` (the run's own fresh uid), until none is left."""
    for _ in range(rounds):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    status = f.read()
            except OSError:
                continue
            fields = dict(x.split(":", 1) for x in status.splitlines() if x.startswith(("Uid:", "State:")))
            real_uid = fields.get("Uid", "").split()[:1]
            zombie = fields.get("State", "").split()[:1] == ["Z"]  # already dead, waiting to be reaped
            if real_uid == [str(uid)] and not zombie:
                found = True
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if not found:
            return
        time.sleep(0.01)


def _read_capped(proc: subprocess.Popen, timeout: float, limit: int) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout/stderr until EOF or timeout, keeping at most `limit` bytes of each.

    Returns (stdout, stderr, truncated, timed_out). Once the main process has exited,
    background children still holding the pipes get a short grace period, then lose.
    """
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    bufs, seen = [bytearray(), bytearray()], [0, 0]
    for i, stream in enumerate((proc.stdout, proc.stderr)):
        os.set_blocking(stream.fileno(), False)
        sel.register(stream.fileno(), selectors.EVENT_READ, i)
    timed_out, exited_at = False, None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = proc.poll() is None
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.25:
                break
            for key, _ in sel.select(min(deadline - now, 0.1)):
                try:
                    chunk = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                i = key.data
                seen[i] += len(chunk)
                room = limit - len(bufs[i])
                if room > 0:
                    bufs[i] += chunk[:room]
    finally:
        sel.close()
    return bytes(bufs[0]), bytes(bufs[1]), max(seen) > limit, timed_out


@dataclass
class PythonSandbox:
    """Limits for running untrusted Python (see the module docstring).

    timeout:          wall-clock seconds before the whole process group is killed
    cpu_seconds:      CPU-time limit (default: ceil(timeout) + 1)
    memory_mb:        address-space limit (RLIMIT_AS)
    file_size_mb:     largest file the code may write (RLIMIT_FSIZE)
    max_processes:    processes and threads of the run's uid (RLIMIT_NPROC)
    max_open_files:   RLIMIT_NOFILE
    max_output_bytes: bytes kept of stdout and of stderr each
    run_as:           "auto" (as root: a fresh unprivileged uid per run), a uid, or None (never drop)
    python:           the interpreter (default sys.executable; when the dropped uid cannot run it,
                      e.g. it lives under a 0700 /root, the first usable system python3)
    confine_writes:   use Landlock, where available, to allow writes only in the working directory
    allow_network:    with Landlock ABI >= 4, TCP connect/bind is denied unless True
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

    # ---- identity and interpreter ---------------------------------------------------------------------
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

    def _limits(self) -> dict[int, int]:
        mb = 1 << 20
        return {
            resource.RLIMIT_CORE: 0,
            resource.RLIMIT_CPU: self.cpu_seconds or math.ceil(self.timeout) + 1,
            resource.RLIMIT_AS: self.memory_mb * mb,
            resource.RLIMIT_FSIZE: self.file_size_mb * mb,
            resource.RLIMIT_NPROC: self.max_processes,
            resource.RLIMIT_NOFILE: self.max_open_files,
        }

    def _spawn(self, python: str, code: str, workdir: str, uid: int | None, gid: int | None) -> subprocess.Popen:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "HOME": workdir, "TMPDIR": workdir}
        abi = landlock.prepare() if self.confine_writes else 0
        setup = functools.partial(_child_setup, self._limits(), uid, gid, workdir, abi > 0,
                                  self.allow_network, abi)
        return subprocess.Popen(
            [python, "-I", "-c", code], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
            preexec_fn=setup,
        )

    def interpreter(self) -> str:
        """The interpreter runs use: the configured one if the sandboxed uid can start it, else a fallback."""
        uid, _, _ = self._identity()
        wanted = self.python or sys.executable
        if uid is None:
            return wanted
        return _usable_interpreter(self, wanted)

    # ---- running --------------------------------------------------------------------------------------
    def run(self, code: str) -> SandboxResult:
        """Run `code` under the limits; never raises for anything the code does."""
        if not isinstance(code, str):
            raise TypeError(f"PythonSandbox.run takes source code as a str, got {type(code).__name__}")
        if len(code) > self.max_code_chars or "\x00" in code:
            why = "contains a NUL byte" if "\x00" in code else f"is over {self.max_code_chars} characters"
            return SandboxResult("", "", None, error=f"the code {why}", timeout=self.timeout)
        return self._run(code, self.interpreter())

    def _run(self, code: str, python: str) -> SandboxResult:
        uid, gid, fresh = self._identity()
        start = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="stlr-sandbox-")
        proc = None
        try:
            if uid is not None:
                os.chown(workdir, uid, gid)
            try:
                proc = self._spawn(python, code, workdir, uid, gid)
            except (OSError, subprocess.SubprocessError) as e:
                return SandboxResult("", "", None, error=f"could not start the interpreter: {e}",
                                     seconds=time.monotonic() - start, timeout=self.timeout)
            out, err, truncated, timed_out = _read_capped(proc, self.timeout, self.max_output_bytes)
        finally:
            if proc is not None:
                _kill_group(proc.pid)
                if fresh:
                    _kill_uid(uid)
                proc.stdout.close()
                proc.stderr.close()
                proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)
        return SandboxResult(
            out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), proc.returncode,
            timed_out=timed_out, truncated=truncated, seconds=time.monotonic() - start,
            timeout=self.timeout, output_limit=self.max_output_bytes,
        )


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_probe_lock = threading.Lock()
_probe_cache: dict[tuple, str] = {}


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
    """`wanted` if a sandboxed run of `pass` works with it, else the first fallback that does."""
    key = (wanted, box.run_as)
    with _probe_lock:
        if key in _probe_cache:
            return _probe_cache[key]
        tried = []
        for candidate in (wanted, *_FALLBACK_PYTHONS):
            if candidate in tried or (candidate != wanted and not os.path.exists(candidate)):
                continue
            tried.append(candidate)
            r = box._run("import sys; print(sys.version_info[0])", candidate)
            if r.ok and r.stdout.strip() == "3":
                _probe_cache[key] = candidate
                return candidate
        raise RuntimeError(
            f"PythonSandbox: no interpreter among {tried} starts as an unprivileged user (e.g. it lives "
            f"under /root, mode 0700; last error: {(r.error or r.stderr)[-300:]!r}). Pass "
            "python='/path/to/python3' readable by all users, or run_as=None to stay root (the "
            "process-count limit is then not enforced)."
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
