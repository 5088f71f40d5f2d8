"""The few Linux syscalls the sandbox launcher needs, through ctypes (Python 3.11 has no os.unshare/os.mount).

Standard library only: the launcher loads this file by path in a fresh `python -I -S` process. Every call
raises OSError (with errno) on failure: `unshare`, `map_ids`, `mount` / `bind_readonly` / `umount`,
`pivot_root`, `join_fresh_session_keyring`, `prctl`, `install_seccomp` (no kernel keyring, inotify,
fanotify or dnotify; no socket families beyond unix / inet).
"""

from __future__ import annotations

import ctypes
import os

NEWNS, NEWCGROUP, NEWUTS, NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
NEWUSER, NEWPID, NEWNET = 0x10000000, 0x20000000, 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38

# syscalls glibc does not wrap: (pivot_root, keyctl) by machine
_SYSCALLS = {"x86_64": (155, 250), "aarch64": (41, 219), "arm64": (41, 219)}
_KEYCTL_JOIN_SESSION_KEYRING = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(result: int, what: str) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    return result


def _b(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def map_ids(uid: int, gid: int) -> None:
    """In a new user namespace: the only mapped ids are the caller's own (the unprivileged case)."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)), f"mount {target}")


def bind_readonly(source: str, target: str) -> None:
    """Bind `source` (recursively) at `target`, then make the top mount read-only, nosuid and nodev.

    A remount must keep the flags that are locked on the source (e.g. noexec), so they are copied.
    """
    mount(source, target, None, MS_BIND | MS_REC)
    keep = os.statvfs(target).f_flag & MS_NOEXEC  # ST_NOEXEC == MS_NOEXEC
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_libc.umount2(_b(target), flags), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    number = _SYSCALLS.get(os.uname().machine, (None, None))[0]
    if number is None:
        raise OSError(38, f"pivot_root: syscall number unknown on {os.uname().machine}")
    _check(_libc.syscall(number, _b(new_root), _b(put_old)), "pivot_root")


def sethostname(name: str) -> None:
    _check(_libc.sethostname(name.encode(), len(name.encode())), "sethostname")


def join_fresh_session_keyring() -> None:
    """A new anonymous session keyring: keys of the caller's session are no longer reachable."""
    number = _SYSCALLS.get(os.uname().machine, (None, None))[1]
    if number is None:
        raise OSError(38, f"keyctl: syscall number unknown on {os.uname().machine}")
    _check(_libc.syscall(number, _KEYCTL_JOIN_SESSION_KEYRING, None), "keyctl(JOIN_SESSION_KEYRING)")


def prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0), f"prctl({option})")


# ---- seccomp: refuse the kernel keyring, file watches, and socket families beyond unix / inet ------------------

PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
F_NOTIFY = 1026  # fcntl's dnotify command (F_LINUX_SPECIFIC_BASE + 2)
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97
# by machine: AUDIT_ARCH; socket and socketpair; the syscalls refused with ENOSYS (add_key, request_key, keyctl:
# the kernel keyring; inotify_init, inotify_init1: watching the host's files being opened); those refused with
# EPERM (fanotify_init, fanotify_mark: what the kernel tells an unprivileged caller before 5.13); fcntl (and
# fcntl64 where the native ABI has it: neither machine does), refused with EPERM for F_NOTIFY (dnotify) only
_SECCOMP_ARCH = {"x86_64": (0xC000003E, (41, 53), (248, 249, 250, 253, 294), (300, 301), (72,)),
                 "aarch64": (0xC00000B7, (198, 199), (217, 218, 219, 26), (262, 263), (25,)),
                 "arm64": (0xC00000B7, (198, 199), (217, 218, 219, 26), (262, 263), (25,))}
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_X32_BIT = 0x40000000
_ARG0, _ARG1 = 16, 24  # offsets of the low 32 bits of args[0] and args[1] in seccomp_data (little-endian)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _assemble(lines: list) -> list[tuple[int, int, int, int]]:
    """(code, true label, false label, k) and ("label", name) lines -> classic BPF with relative jumps."""
    at, pc = {}, 0
    for line in lines:
        if line[0] == "label":
            at[line[1]] = pc
        else:
            pc += 1
    out: list[tuple[int, int, int, int]] = []
    for line in lines:
        if line[0] != "label":
            code, jt, jf, k = line
            jumps = [0 if t is None else at[t] - len(out) - 1 for t in (jt, jf)]
            out.append((code, jumps[0], jumps[1], k))
    return out


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]] | None:
    """The classic-BPF filter as (code, jt, jf, k): the kernel keyring syscalls and inotify fail with ENOSYS
    (as in a kernel without them); fanotify_init, fanotify_mark and fcntl(fd, F_NOTIFY, ...) with EPERM (no
    watching exposed host files: other fcntl commands pass); socket / socketpair of a family other than
    AF_UNIX, AF_INET, AF_INET6 with EAFNOSUPPORT (AF_VSOCK ignores network namespaces); other ABIs (i386,
    x32) with ENOSYS; all else is allowed. None on machines whose syscall numbers are not listed."""
    if machine not in _SECCOMP_ARCH:
        return None
    arch, sockets, enosys, eperm, fcntls = _SECCOMP_ARCH[machine]
    x32 = _X32_BIT if machine == "x86_64" else 0xFFFFFFFF
    lines = [(_LD_W_ABS, None, None, 4), (_JEQ_K, "native", "enosys", arch), ("label", "native"),
             (_LD_W_ABS, None, None, 0), (_JGE_K, "enosys", None, x32)]
    lines += [(_JEQ_K, "enosys", None, nr) for nr in enosys]
    lines += [(_JEQ_K, "eperm", None, nr) for nr in eperm]
    lines += [(_JEQ_K, "fcntl", None, nr) for nr in fcntls]
    lines += [(_JEQ_K, "family", None, nr) for nr in sockets]
    lines += [(_RET_K, None, None, _RET_ALLOW), ("label", "family"), (_LD_W_ABS, None, None, _ARG0)]
    lines += [(_JEQ_K, "allow", None, family) for family in (AF_UNIX, AF_INET, AF_INET6)]
    lines += [(_RET_K, None, None, _RET_ERRNO | _EAFNOSUPPORT),
              ("label", "fcntl"), (_LD_W_ABS, None, None, _ARG1), (_JEQ_K, "eperm", "allow", F_NOTIFY),
              ("label", "allow"), (_RET_K, None, None, _RET_ALLOW),
              ("label", "eperm"), (_RET_K, None, None, _RET_ERRNO | _EPERM),
              ("label", "enosys"), (_RET_K, None, None, _RET_ERRNO | _ENOSYS)]
    return _assemble(lines)


def install_seccomp() -> bool:
    """Install `seccomp_program` for this process and its children (needs no_new_privs first); False when
    this machine has no program."""
    program = seccomp_program(os.uname().machine)
    if program is None:
        return False
    filters = (_SockFilter * len(program))(*(_SockFilter(*ins) for ins in program))
    prog = _SockFprog(len(program), filters)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0), "prctl(PR_SET_SECCOMP)")
    return True
