"""The sandbox launcher: PythonSandbox runs `python -I -S sandbox_launch.py KEY=VALUE ...` with the code on stdin.

Standard library only; linux.py and landlock.py are loaded from this directory by path.

isolation=namespaces, three stages:
  A  (the caller's child): new mount, PID, IPC, UTS, network (and, not root, user) namespaces; forks B,
     reports B's pid, waits for B without reaping it, then waits to be killed.
  B  (PID 1 of the new PID namespace): joins the run's cgroup and a cgroup namespace, builds a new root
     on a tmpfs, pivots into it and forks C; reports C's wait status and exits (the kernel kills the rest).
  C  a fresh session keyring, rlimits, the run's uid, no_new_privs, Landlock, then exec `python -I -`.
isolation=process: C's steps only, then exec.

Lines on the control pipe: "pid N", "exit STATUS", "unsupported WHY", "error WHY".
"""

import fcntl
import os
import resource
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name):
    """Import a module of this directory by path (the launcher runs without the package on sys.path)."""
    path = os.path.join(_HERE, name + ".py")
    module = type(sys)("_stlr_sandbox_" + name)
    module.__file__ = path
    sys.modules[module.__name__] = module
    with open(path, encoding="utf-8") as f:
        exec(compile(f.read(), path, "exec"), module.__dict__)
    return module


linux = _load("linux")
landlock = _load("landlock")


def _read_config(fd: int) -> list[str]:
    """KEY=VALUE entries, NUL-separated, from the caller's pipe (the config never shows in /proc/PID/cmdline)."""
    data = b""
    while chunk := os.read(fd, 1 << 16):
        data += chunk
    os.close(fd)
    return [a for a in data.decode("utf-8", "surrogateescape").split("\0") if a]


def _config(argv):
    if len(argv) == 1 and argv[0].startswith("config_fd="):
        argv = _read_config(int(argv[0].partition("=")[2]))
    cfg = {}
    for arg in argv:
        key, _, value = arg.partition("=")
        cfg.setdefault(key, []).append(value)
    return cfg


def _one(cfg, key, default=None):
    return cfg.get(key, [default])[-1]


def _report(fd, line):
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _silence(*fds):
    """Point `fds` at /dev/null: only the program writes to the caller's stdout and stderr."""
    null = os.open("/dev/null", os.O_RDWR)
    for fd in fds:
        os.dup2(null, fd)
    os.close(null)


def _close_quietly(*fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# ---- C: confine the process and exec the program ---------------------------------------------------------

def _confine_and_exec(cfg, control):
    """Never returns: execs the interpreter, or reports why not and exits 127."""
    workdir, python = _one(cfg, "workdir"), _one(cfg, "python")
    try:
        try:
            linux.join_fresh_session_keyring()
        except OSError as e:
            if e.errno != 38:  # ENOSYS: no keyrings in this kernel, so none to leak
                raise
        for spec in cfg.get("rlimit", []):
            name, value = spec.split(":")
            limit, value = getattr(resource, name), int(value)
            hard = resource.getrlimit(limit)[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            # CPU: soft -> SIGXCPU, hard one second later -> SIGKILL
            soft = max(1, value - 1) if limit == resource.RLIMIT_CPU else value
            resource.setrlimit(limit, (soft, value))
        uid = _one(cfg, "uid")
        if uid is not None:
            gid = int(_one(cfg, "gid"))
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(int(uid), int(uid), int(uid))
        linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
        abi = int(_one(cfg, "landlock", "0"))
        if abi > 0:
            landlock.restrict_writes(workdir, also_writable=tuple(cfg.get("writable", [])),
                                     allow_network=_one(cfg, "network") == "1", abi=abi)
        linux.install_seccomp()  # no kernel keyring, inotify, fanotify or dnotify; sockets of unix / inet only
        secret, report = _one(cfg, "secret_fd"), _one(cfg, "report_fd")
        if secret is not None:  # the program's private pipes become fds 3 and 4
            moved = [fcntl.fcntl(int(fd), fcntl.F_DUPFD, 10) for fd in (secret, report)]  # clear of 3 and 4
            os.dup2(moved[0], 3)
            os.dup2(moved[1], 4)
            _close_quietly(*moved, *({int(secret), int(report)} - {3, 4}))
        os.chdir(workdir)
    except (OSError, ValueError, AttributeError) as e:
        _report(control, f"error could not confine the program: {e}")
        os._exit(127)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "HOME": workdir, "TMPDIR": workdir}
    try:
        os.execve(python, [python, "-I", "-"], env)
    except OSError as e:
        _report(control, f"error could not start the interpreter {python}: {e}")
        os._exit(127)


# ---- B: the new root, then PID 1 of the run ------------------------------------------------------------------

_DEVICES = ("null", "zero", "full", "random", "urandom")


_LOCK_FILES = (".lock",)  # uv's venv lock: `uv run` on the host waits while anyone holds it


def _mask_lock_files(root: str, path: str, target: str) -> None:
    """Cover the exposed directory's lock files with empty files of the run's own tmpfs: a lock a run takes
    there locks its copy, never the host's (a run could otherwise hold the host's `uv run` for its timeout)."""
    for name in _LOCK_FILES:
        if os.path.isfile(os.path.join(path, name)) and not os.path.islink(os.path.join(path, name)):
            blank = f"{root}/.stlr-blank-{len(os.listdir(root))}"
            open(blank, "a").close()
            linux.mount(blank, os.path.join(target, name), None, linux.MS_BIND)


def _build_root(cfg):
    """Mount the run's file system view on `root` (an empty directory) and pivot into it."""
    root, workdir = _one(cfg, "root"), _one(cfg, "workdir")
    linux.mount("stlr-sandbox", root, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, _one(cfg, "tmpfs"))
    for path in cfg.get("expose", []):
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(path):
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
            linux.bind_readonly(path, target)
            _mask_lock_files(root, path, target)
        elif os.path.exists(path):
            open(target, "a").close()
            linux.bind_readonly(path, target)
    os.makedirs(root + "/dev/shm")
    os.chmod(root + "/dev/shm", 0o1777)
    for name in _DEVICES:
        open(f"{root}/dev/{name}", "a").close()
        linux.mount(f"/dev/{name}", f"{root}/dev/{name}", None, linux.MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc")
    linux.mount("proc", root + "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    os.makedirs(root + workdir, mode=0o700)
    uid = _one(cfg, "uid")
    if uid is not None:
        os.chown(root + workdir, int(uid), int(_one(cfg, "gid")))
    os.chdir(root)
    linux.pivot_root(".", ".")  # the old root now lies on top of the new one at "/"
    linux.umount(".")  # detach it: nothing outside the new root is reachable any more
    os.chdir("/")
    linux.sethostname("sandbox")


def _init(cfg, control, lifeline):
    """Stage B: never returns."""
    step = "setting up the run's init"
    try:
        linux.prctl(linux.PR_SET_PDEATHSIG, 9)
        os.set_blocking(lifeline, False)
        try:
            if os.read(lifeline, 1) == b"":  # A died before PDEATHSIG was set
                os._exit(1)
        except BlockingIOError:
            pass
        os.close(lifeline)
        linux.prctl(linux.PR_SET_DUMPABLE, 0)  # the program (another uid or no capabilities) cannot ptrace us
        step = "joining the run's cgroup"
        for procs in cfg.get("cgroup", []):
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        if cfg.get("cgroup"):
            try:  # the OOM killer takes the program's processes, not the init (needs CAP_SYS_RESOURCE)
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("-1000")
            except OSError:
                pass
        try:  # after joining: the run's cgroup becomes the root of its view (/proc/self/cgroup: "/" on each line)
            linux.unshare(linux.NEWCGROUP)
        except OSError:  # a kernel without cgroup namespaces (< 4.6): the run sees its cgroup's full path
            pass
        step = "building the run's root"
        _build_root(cfg)
    except OSError as e:
        _report(control, f"unsupported {step}: {e}")
        os._exit(1)
    child = os.fork()
    if child == 0:
        _confine_and_exec(cfg, control)
    _silence(0, 1, 2)
    _close_quietly(*(int(v) for k in ("secret_fd", "report_fd") for v in cfg.get(k, [])))
    while True:  # reap every orphan; when the program ends, so does the namespace
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if pid == child:
            _report(control, f"exit {status}")
            os._exit(0)


def _namespaces(cfg, control):
    """Stage A."""
    try:
        linux.prctl(linux.PR_SET_PDEATHSIG, 9)
        flags = linux.NEWNS | linux.NEWPID | linux.NEWIPC | linux.NEWUTS
        if _one(cfg, "network") != "1":
            flags |= linux.NEWNET
        userns = _one(cfg, "userns") == "1"
        uid, gid = os.getuid(), os.getgid()
        linux.unshare(flags | (linux.NEWUSER if userns else 0))
        if userns:
            linux.map_ids(uid, gid)
        linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    except OSError as e:
        _report(control, f"unsupported creating namespaces: {e}")
        os._exit(1)
    lifeline_r, lifeline_w = os.pipe()
    null = os.open("/dev/null", os.O_RDWR)
    pid = os.fork()
    if pid == 0:
        os.close(lifeline_w)
        os.close(null)
        _init(cfg, control, lifeline_r)
    os.close(lifeline_r)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    _close_quietly(null, *(int(v) for k in ("secret_fd", "report_fd") for v in cfg.get(k, [])))
    _report(control, f"pid {pid}")
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # B stays a zombie: its pid is not reused
    except ChildProcessError:
        pass
    os.close(control)
    while True:  # until the caller kills us (after B, whose pid we hold)
        time.sleep(3600)


def main(argv):
    cfg = _config(argv)
    control = int(_one(cfg, "control"))
    os.set_inheritable(control, False)
    os.umask(0o022)
    if _one(cfg, "isolation") == "namespaces":
        _namespaces(cfg, control)
    else:
        _confine_and_exec(cfg, control)


if __name__ == "__main__":
    main(sys.argv[1:])
