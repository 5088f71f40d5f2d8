"""Linux Landlock (kernel >= 5.13) through raw syscalls: confine a process's writes to one directory.

After `restrict_writes(dir)` (in the sandbox's forked child, before `exec`) the process and its children
write only under `dir` (and `also_writable`, and /dev/null); ABI >= 4 also forbids TCP bind / connect,
ABI >= 6 signals outside its domain. Irreversible, inherited; a no-op where Landlock is missing.
"""

from __future__ import annotations

import ctypes
import functools
import os

# syscall numbers are the same on x86_64 and aarch64 (the generic table)
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# filesystem access rights, by the ABI version that introduced them
_WRITE_FILE = 1 << 1
_REMOVE_DIR, _REMOVE_FILE = 1 << 4, 1 << 5
_MAKE_ALL = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


@functools.lru_cache(maxsize=1)
def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is unavailable (or not Linux)."""
    try:
        v = _libc().syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(v), 0)


def prepare() -> int:
    """Call in the parent before forking: loads libc and probes the ABI (no work in the child)."""
    return abi_version()


def restrict_writes(directory: str, *, also_writable: tuple[str, ...] = (), allow_network: bool = False,
                    abi: int | None = None) -> bool:
    """Confine the calling process as described above; returns False where Landlock is unavailable."""
    abi = abi_version() if abi is None else abi
    if abi < 1:
        return False
    libc = _libc()
    write_fs = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE_ALL
    if abi >= 2:
        write_fs |= _REFER
    if abi >= 3:
        write_fs |= _TRUNCATE
    attr = _RulesetAttr(write_fs, 0, 0)
    size = 8
    if abi >= 4 and not allow_network:
        attr.handled_access_net, size = _NET_BIND_TCP | _NET_CONNECT_TCP, 16
    if abi >= 6:
        attr.scoped, size = _SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL, 24
    ruleset = libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        rules = [(d, write_fs) for d in (directory, *also_writable)]
        rules.append(("/dev/null", _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0)))
        for path, access in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneathAttr(access, fd)
                if libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return True
