"""One sandbox run, parent side: start the launcher, read its output under a deadline, clean up in bounded time.

    launch = start(Spec(...))                     # sandbox_launch.py, with the code on stdin
    outcome = watch(launch, timeout, max_bytes)   # output, the program's wait status, timed out?
    finish(launch, outcome)                       # kill, reap (never blocking), remove what it left

Nothing here raises for what the program does; `finish` never waits longer than `_REAP_SECONDS` for a
process (a stuck one is reaped by a background thread).
"""

from __future__ import annotations

import fcntl
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from SimpleTorchLLMRL.tools.cgroups import RunCgroup

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launch.py")
INSIDE_WORKDIR = "/tmp/sandbox"  # the working directory as the program sees it (namespaces)
_REAP_SECONDS = 2.0
_GRACE_SECONDS = 0.25  # after the program ended: how long background holders of its pipes may keep writing
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "passwd", "group",
              "hosts", "host.conf", "gai.conf", "resolv.conf", "ssl", "ca-certificates", "mime.types",
              "protocols", "services")


@dataclass
class Spec:
    """What one run needs. uid/gid: the identity to drop to (None: keep the caller's)."""

    code: str
    python: str
    isolation: str  # "namespaces" or "process"
    rlimits: dict[str, int]
    uid: int | None
    gid: int | None
    fresh_uid: bool
    memory_bytes: int
    max_processes: int
    allow_network: bool
    landlock_abi: int
    secret: bytes | None = None
    report_limit: int = 4096  # bytes of fd 4 kept


@dataclass
class Launch:
    proc: subprocess.Popen
    spec: Spec
    workdir: str  # namespaces: the empty mount point of the run's root; process: the working directory
    control: int
    report: int | None
    cgroup: RunCgroup | None
    init_pid: int | None = None


@dataclass
class Outcome:
    stdout: bytes = b""
    stderr: bytes = b""
    truncated: bool = False
    timed_out: bool = False
    exit_code: int | None = None
    error: str | None = None
    unsupported: str | None = None
    report: bytes = b""
    lines: list[str] = field(default_factory=list)


# ---- what the run sees of the file system (namespaces) --------------------------------------------------------

def exposed_paths(python: str) -> list[str]:
    """System directories, a few /etc files, the interpreter's installation(s) and, when the run uses the
    caller's interpreter, every site directory on the caller's path (`site_dirs`), all bound read-only."""
    paths = [d for d in _SYSTEM_DIRS if os.path.lexists(d)]
    paths += [f"/etc/{name}" for name in _ETC_FILES if os.path.lexists(f"/etc/{name}")]
    prefixes = {os.path.dirname(os.path.dirname(os.path.realpath(python)))}
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")):
        prefixes.add(venv)
        with open(os.path.join(venv, "pyvenv.cfg"), encoding="utf-8", errors="replace") as cfg:
            for line in cfg:
                key, _, value = line.partition("=")
                if key.strip() == "home" and value.strip():
                    prefixes.add(os.path.dirname(os.path.realpath(value.strip())))
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        prefixes |= {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
        prefixes |= set(site_dirs())
    covered = [p for p in paths if not os.path.islink(p)]
    for prefix in sorted(prefixes, key=len):  # a prefix inside one already bound adds nothing
        if prefix not in ("/", "") and not any(prefix == c or prefix.startswith(c + "/") for c in covered):
            covered.append(prefix)
            paths.append(prefix)
    return paths


def site_dirs() -> list[str]:
    """The site directories on the caller's path: its venv's, the system's, and those a `.pth` file added
    (`uv run --with X` runs an overlay venv whose `.pth` adds X's environment and the project's venv). Only
    directories named site-packages or dist-packages: a path entry such as the project's own folder (an
    editable install) or the script's may hold data the run must not read."""
    found = []
    for entry in sys.path:
        path = os.path.abspath(entry) if entry else ""
        if os.path.basename(path) in ("site-packages", "dist-packages") and os.path.isdir(path):
            found.append(path)
    return list(dict.fromkeys(found))


# ---- start ---------------------------------------------------------------------------------------------------

def _arguments(spec: Spec, workdir: str, control: int, pipes: tuple[int, int] | None,
               cgroup: RunCgroup | None) -> list[str]:
    args = [f"isolation={spec.isolation}", f"python={spec.python}", f"control={control}",
            f"network={int(spec.allow_network)}", f"landlock={spec.landlock_abi}"]
    args += [f"rlimit={name}:{value}" for name, value in spec.rlimits.items()]
    if spec.uid is not None:
        args += [f"uid={spec.uid}", f"gid={spec.gid}"]
    if pipes is not None:
        args += [f"secret_fd={pipes[0]}", f"report_fd={pipes[1]}"]
    if spec.isolation == "namespaces":
        inodes = 65536
        args += [f"root={workdir}", f"workdir={INSIDE_WORKDIR}", f"userns={int(os.geteuid() != 0)}",
                 f"tmpfs=size={spec.memory_bytes},nr_inodes={inodes},mode=755", "writable=/dev/shm"]
        args += [f"expose={p}" for p in exposed_paths(spec.python)]
        args += [f"cgroup={p}" for p in (cgroup.procs_files if cgroup else [])]
    else:
        args.append(f"workdir={workdir}")
    return args


def start(spec: Spec) -> Launch:
    """Spawn the launcher. Raises OSError / SubprocessError only when nothing could be started."""
    workdir = tempfile.mkdtemp(prefix="stlr-sandbox-")
    opened: list[int] = []
    cgroup = None
    try:
        if spec.uid is not None and spec.isolation == "process":
            os.chown(workdir, spec.uid, spec.gid)
        code_file = read_only_code(spec.code.encode("utf-8", "surrogatepass"))
        with code_file:
            control_r, control_w = os.pipe()
            opened += [control_r, control_w]
            pipes, report_r = None, None
            if spec.secret is not None:
                secret_r, secret_w = os.pipe()
                report_r, report_w = os.pipe()
                opened += [secret_r, secret_w, report_r, report_w]
                os.write(secret_w, spec.secret)  # small: fits the pipe buffer
                os.close(secret_w)
                opened.remove(secret_w)
                pipes = (secret_r, report_w)
            if spec.isolation == "namespaces":
                cgroup = RunCgroup.create(spec.memory_bytes, spec.max_processes + 1)  # + the run's init
            config = "\0".join(_arguments(spec, workdir, control_w, pipes, cgroup)).encode("utf-8", "surrogateescape")
            config_r, config_w = os.pipe()  # the configuration goes by pipe: the run's init shows no argv of it
            opened += [config_r, config_w]
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", LAUNCHER, f"config_fd={config_r}"], stdin=code_file,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(control_w, config_r, *(pipes or ())),
                close_fds=True, env={}, cwd="/", start_new_session=True,
            )
            os.close(config_r)
            opened.remove(config_r)
            _write_all(config_w, config)
            os.close(config_w)
            opened.remove(config_w)
        for fd in (control_w, *(pipes or ())):
            os.close(fd)
            opened.remove(fd)
        return Launch(proc, spec, workdir, control_r, report_r, cgroup)
    except BaseException:
        for fd in opened:
            os.close(fd)
        if cgroup is not None:
            cgroup.remove()
        remove_tree(workdir)
        raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_only_code(code: bytes):
    """The program as a read-only file object for the run's stdin: a sealed memfd (in memory, not on the host's
    disk; no write, grow or shrink, even through a reopened /proc/self/fd/0), else an unnamed 0600 temp file."""
    seals = ("F_ADD_SEALS", "F_SEAL_WRITE", "F_SEAL_GROW", "F_SEAL_SHRINK", "F_SEAL_SEAL")
    if hasattr(os, "memfd_create") and all(hasattr(fcntl, n) for n in seals):
        fd = os.memfd_create("code", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            _write_all(fd, code)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(fd)
        return os.fdopen(ro, "rb")
    f = tempfile.TemporaryFile()  # unnamed, 0600: the code never appears in argv or on a path
    f.write(code)
    f.seek(0)
    return f


# ---- watch ---------------------------------------------------------------------------------------------------

def watch(launch: Launch, timeout: float, limit: int) -> Outcome:
    """Read stdout/stderr (at most `limit` bytes each kept), the control and report pipes, until the end or timeout."""
    out = Outcome()
    proc, namespaces = launch.proc, launch.spec.isolation == "namespaces"
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    bufs, seen, control = [bytearray(), bytearray()], [0, 0], bytearray()
    streams = [(proc.stdout.fileno(), 0), (proc.stderr.fileno(), 1), (launch.control, 2)]
    if launch.report is not None:
        streams.append((launch.report, 3))
    for fd, i in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ, i)
    ended_at, status = None, None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                out.timed_out = status is None and (namespaces or proc.poll() is None)
                break
            if ended_at is None and (status is not None or proc.poll() is not None):
                ended_at = now  # the program (or, with namespaces, the launcher) is gone
            if ended_at is not None and now - ended_at > _GRACE_SECONDS:
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
                if i < 2:
                    seen[i] += len(chunk)
                    room = limit - len(bufs[i])
                    if room > 0:
                        bufs[i] += chunk[:room]
                elif i == 2:
                    control += chunk
                    while b"\n" in control:
                        line, _, rest = bytes(control).partition(b"\n")
                        control[:] = rest
                        status = _control_line(launch, out, line.decode("utf-8", "replace"), status)
                elif len(out.report) < launch.spec.report_limit:
                    out.report += chunk[: launch.spec.report_limit - len(out.report)]
    finally:
        sel.close()
    out.stdout, out.stderr, out.truncated = bytes(bufs[0]), bytes(bufs[1]), max(seen) > limit
    if namespaces:
        out.exit_code = -signal.SIGKILL if out.timed_out else (
            os.waitstatus_to_exitcode(status) if status is not None else None)
    return out


def _control_line(launch: Launch, out: Outcome, line: str, status: int | None) -> int | None:
    kind, _, rest = line.partition(" ")
    out.lines.append(line)
    if kind == "pid" and rest.isdigit():
        launch.init_pid = int(rest)
    elif kind == "exit" and rest.lstrip("-").isdigit():
        return int(rest)
    elif kind == "unsupported":
        out.unsupported = rest
    elif kind == "error":
        out.error = rest
    return status


# ---- finish --------------------------------------------------------------------------------------------------

def finish(launch: Launch, outcome: Outcome) -> None:
    """Kill whatever is left of the run, reap without blocking for long, remove its files and cgroup."""
    proc, spec = launch.proc, launch.spec
    if launch.init_pid is not None:
        _kill(launch.init_pid)  # safe: the launcher, not yet reaped, holds that pid until we kill it too
    if spec.isolation == "process":
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        if spec.fresh_uid:
            kill_uid(spec.uid)
    if proc.returncode is None:
        _kill(proc.pid)
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    for fd in (launch.control, launch.report):
        if fd is not None:
            os.close(fd)
    try:
        proc.wait(timeout=_REAP_SECONDS)
    except subprocess.TimeoutExpired:  # e.g. held by a tracer: reaped in the background, never waited for here
        threading.Thread(target=proc.wait, name="stlr-sandbox-reaper", daemon=True).start()
    if spec.isolation == "process" and outcome.exit_code is None:
        outcome.exit_code = proc.returncode  # -SIGKILL after a timeout; None if still not reaped
    if launch.cgroup is not None:
        launch.cgroup.remove()
    remove_tree(launch.workdir)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def kill_uid(uid: int, rounds: int = 50) -> None:
    """SIGKILL every process whose real uid is `uid` (a run's own fresh uid), zombie leaders with live threads too."""
    for _ in range(rounds):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(x.split(":", 1) for x in f.read().splitlines() if ":" in x)
            except (OSError, ValueError):
                continue
            if fields.get("Uid", "").split()[:1] != [str(uid)]:
                continue
            if fields.get("State", "").split()[:1] != ["Z"] or fields.get("Threads", "1").strip() != "1":
                found = True
            _kill(int(entry))
        if not found:
            return
        time.sleep(0.01)


def remove_tree(path: str, seconds: float = 10.0) -> None:
    """Delete a directory tree iteratively (any depth, one open directory at a time); gives up after `seconds`."""
    deadline = time.monotonic() + seconds
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    names: list[str] = []  # the path from `path` down to the open directory
    try:
        while time.monotonic() < deadline:
            sub = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        sub = entry.name
                        break
                    try:
                        os.unlink(entry.name, dir_fd=fd)
                    except OSError:
                        pass
            if sub is not None:
                child = os.open(sub, flags, dir_fd=fd)
                os.close(fd)
                fd = child
                names.append(sub)
                continue
            if not names:
                break
            parent = os.open("..", flags, dir_fd=fd)
            os.close(fd)
            fd = parent
            try:
                os.rmdir(names.pop(), dir_fd=fd)
            except OSError:
                return
    except OSError:
        return
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass
