"""One cgroup per sandbox run: a memory and a process limit for the run's whole process tree (root only).

    group = RunCgroup.create(memory_bytes=256 << 20, max_pids=17)   # None where unusable
    group.procs_files      # the run's init writes its pid into each
    group.remove()         # after the run; retried at the next create if still busy

cgroup v2 where its memory and pids controllers are enabled for children of the
caller's cgroup or of its parent; else cgroup v1 (a memory and a pids hierarchy,
each optional). Nothing is mounted or enabled here: a host without usable
controllers gets None, and the sandbox documents the per-process bound instead.
"""

from __future__ import annotations

import os
import secrets
import threading

_ROOT = "/sys/fs/cgroup"
_leftovers: set[str] = set()  # cgroups whose removal failed (still busy); retried later
_lock = threading.Lock()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _own_cgroups() -> dict[str, str]:
    """{controller or '' for v2: path} from /proc/self/cgroup."""
    out = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _v2_parent(own: dict[str, str]) -> str | None:
    """A v2 directory whose children get the memory and pids controllers."""
    mount = next((m for m in (_ROOT, _ROOT + "/unified") if os.path.exists(m + "/cgroup.controllers")), None)
    if mount is None or "" not in own:
        return None
    path = own[""].rstrip("/")
    for candidate in (path, os.path.dirname(path) if path else None):
        if candidate is None:
            continue
        directory = mount + candidate
        if {"memory", "pids"} <= set(_read(directory + "/cgroup.subtree_control").split()):
            return directory
    return None


class RunCgroup:
    def __init__(self, dirs: list[str], procs_files: list[str]):
        self.dirs, self.procs_files = dirs, procs_files

    @classmethod
    def create(cls, memory_bytes: int, max_pids: int) -> RunCgroup | None:
        if os.geteuid() != 0:
            return None
        _retry_leftovers()
        own = _own_cgroups()
        name = "stlr-sandbox-" + secrets.token_hex(6)
        v2 = _v2_parent(own)
        if v2 is not None:
            limits = {"memory": [("memory.max", memory_bytes), ("memory.swap.max", 0)],
                      "pids": [("pids.max", max_pids)]}
            return cls._make([(v2 + "/" + name, [x for v in limits.values() for x in v])])
        plan = []
        for controller, limits in (("memory", [("memory.limit_in_bytes", memory_bytes)]),
                                   ("pids", [("pids.max", max_pids)])):
            base = f"{_ROOT}/{controller}"
            if controller in own and os.path.exists(base + "/cgroup.procs"):
                plan.append((base + own[controller].rstrip("/") + "/" + name, limits))
        return cls._make(plan) if plan else None

    @classmethod
    def _make(cls, plan: list[tuple[str, list[tuple[str, int]]]]) -> RunCgroup | None:
        made: list[str] = []
        try:
            for directory, limits in plan:
                os.mkdir(directory)
                made.append(directory)
                for filename, value in limits:
                    if os.path.exists(f"{directory}/{filename}"):  # memory.swap.max: only with swap accounting
                        _write(f"{directory}/{filename}", str(value))
        except OSError:
            cls(made, []).remove()
            return None
        return cls(made, [d + "/cgroup.procs" for d in made])

    def remove(self) -> None:
        """rmdir each directory; one still busy (tasks not yet gone) is retried at a later create."""
        for d in self.dirs:
            if not _rmdir(d):
                with _lock:
                    _leftovers.add(d)


def _rmdir(directory: str) -> bool:
    """Remove an empty cgroup directory; False when it is still busy."""
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _retry_leftovers() -> None:
    with _lock:
        pending = list(_leftovers)
    for d in pending:
        if _rmdir(d):
            with _lock:
                _leftovers.discard(d)
