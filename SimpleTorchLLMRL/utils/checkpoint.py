"""Atomic training checkpoints: write to a temp dir, verify, then rename.

A checkpoint directory `step-000123/` holds:
    model.safetensors   trainable state (the adapter only, for a peft model)
    optimizer.pt        optimizer (and scheduler) state
    rng.pt              Python, NumPy and torch RNG states
    state.json          step, data position and anything the caller adds
    extra.pt            more state the caller adds (a critic, a second optimizer), when given
    MANIFEST.json       size and sha256 of every file above, written last

A corrupt or partial one is never loaded. Errors are one-line `CheckpointError`s (a full disk: ENOSPC).
"""

from __future__ import annotations

import errno
import gc
import hashlib
import json
import os
import random
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from SimpleTorchLLMRL.utils.warn import warn_user

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, so no temporary folder is ever removed
    fcntl = None

PREFIX = "step-"
TMP_PREFIX = f".tmp-{PREFIX}"
MANIFEST = "MANIFEST.json"
LOW_SPACE = 1 << 20  # bytes: below this, a write that failed without an errno failed for space


class CheckpointError(OSError):
    """A checkpoint that cannot be read or written as asked; the message is one line naming the path."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _holds_adapters(model) -> bool:
    """A peft model, told as `model.lora.is_peft_model` tells it (`peft_config` and `disable_adapter`).

    Asked here, not imported: utils sits under every library package and imports none of them
    (docs/architecture.md, the layers); `tests/utils/test_checkpoint.py` holds the two to the same answers.
    """
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def _model_state(model) -> dict[str, torch.Tensor]:
    if _holds_adapters(model):
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model)
    else:
        state = model.state_dict()
    # safetensors refuses shared storage (tied embeddings): store independent contiguous copies.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def _load_model_state(model, state: dict[str, torch.Tensor]) -> None:
    if _holds_adapters(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, state)
    else:
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as e:  # "size mismatch for ...": another architecture's weights
            detail = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e))
            raise ValueError(f"checkpoint does not fit the model: {detail}") from e
        tied = set(getattr(model, "_tied_weights_keys", None) or ())  # a list, or a dict of tied names
        if unexpected or [k for k in missing if k not in tied]:
            raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: str | os.PathLike, step: int, model, optimizer=None, scheduler=None,
                    state: dict[str, Any] | None = None, keep_last: int | None = 2,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write `directory/step-{step:06d}` atomically; returns its path.

    state: JSON-ready values for state.json; extra: anything `torch.save` holds (state dicts of a
    critic or a second optimizer), given back by `load_checkpoint(...)["extra"]`. keep_last: how
    many checkpoints up to this step to keep (older ones are deleted; newer ones are never touched).
    CheckpointError on a full disk (the partial folder is removed) or an unusable `directory`.
    """
    root = Path(directory)
    check_directory(root)
    final = root / f"{PREFIX}{step:06d}"
    tmp = lock_fd = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp, lock_fd = _claim_tmp(root, step)
        _write_files(tmp, step, model, optimizer, scheduler, state, extra)
        _publish(tmp, final)
    except BaseException as e:
        full = isinstance(e, Exception) and _out_of_space(e, root)  # measured before the partial files go
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise _no_space(final, e) from e
        raise
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    if keep_last:
        _prune(root, step, keep_last)
    return final


def _write_files(tmp: Path, step: int, model, optimizer, scheduler, state, extra) -> None:
    save_file(_model_state(model), str(tmp / "model.safetensors"))
    torch.save({"optimizer": optimizer.state_dict() if optimizer is not None else None,
                "scheduler": scheduler.state_dict() if scheduler is not None else None}, tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **(state or {})}, indent=1))
    if extra is not None:
        torch.save(extra, tmp / "extra.pt")
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir())}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))


def _prune(root: Path, step: int, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints up to `step`; say so when newer ones exist."""
    candidates = _candidates(root)  # newest first
    newer = [p for p in candidates if _step_of(p) > step]
    if newer:
        warn_user(f"{root} holds {newer[0].name}, newer than {PREFIX}{step:06d} just written: it is left in "
                  "place, and resuming would load it (empty the directory to start over)")
    for old in [p for p in candidates if _step_of(p) <= step][keep_last:]:
        try:
            shutil.rmtree(old)
        except OSError as e:
            warn_user(f"could not delete the old checkpoint {old}: {e}")


def check_directory(path: str | os.PathLike) -> None:
    """CheckpointError (one line naming `path`) unless `path` is missing or a readable directory.

    A symlink to a directory is fine; a dangling one, a file or a directory that cannot be listed is not.
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if path.is_symlink():
            raise CheckpointError(f"{path} is a dangling symlink (to {os.readlink(path)})") from None
        return
    except OSError as e:  # a symlink loop, a parent that cannot be searched
        raise CheckpointError(f"{path} cannot be read: {e.strerror or e}") from e
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"{path} is not a directory")
    try:
        os.listdir(path)  # Path.glob would take an unreadable directory for an empty one
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e.strerror or e}") from e


def _claim_tmp(root: Path, step: int) -> tuple[Path, int | None]:
    """(a new temporary folder for `step`, the fd holding its lock). Orphans are removed on the way.

    The directory's own lock is held meanwhile, so no other writer sees our folder before it is locked.
    """
    root_fd = _open_dir(root)
    try:
        if _flock(root_fd, blocking=True):
            _remove_orphans(root)
        tmp = root / f"{TMP_PREFIX}{step:06d}-{os.getpid()}-{secrets.token_hex(3)}"
        tmp.mkdir()
        fd = _open_dir(tmp)
        if fd is not None and not _flock(fd):
            os.close(fd)
            fd = None
        return tmp, fd
    finally:
        if root_fd is not None:
            os.close(root_fd)  # releases the directory's lock


def _remove_orphans(root: Path) -> None:
    """Remove the temporary folders whose writer is gone (their lock can be taken): never loaded, never complete."""
    for tmp in root.glob(f"{TMP_PREFIX}*"):
        fd = _open_dir(tmp) if tmp.is_dir() and not tmp.is_symlink() else None
        if fd is None:
            continue
        try:
            if _flock(fd):
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            os.close(fd)


def _open_dir(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return None


def _flock(fd: int | None, blocking: bool = False) -> bool:
    """Take an exclusive flock on `fd`: False when another holder has it or the filesystem has no flock."""
    if fcntl is None or fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError:  # BlockingIOError: held by a live writer; ENOLCK / EBADF / EINVAL: no flock here
        return False
    return True


def _out_of_space(error: BaseException, directory: Path) -> bool:
    """Whether `error` (raised while writing into `directory`) means the disk or the quota is full.

    OSError carries errno ENOSPC / EDQUOT; safetensors says "No space left on device (os error 28)"; torch.save
    says only "[enforce fail at inline_container.cc:...]", so the free space of `directory` decides.
    """
    chain = _chain(error)
    for e in chain:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
    if any(isinstance(e, RuntimeError) and ("inline_container.cc" in str(e) or "PytorchStreamWriter" in str(e))
           for e in chain):
        try:
            return shutil.disk_usage(directory).free < LOW_SPACE
        except OSError:
            return False
    return False


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and what it was raised from or during (__cause__, __context__)."""
    chain = [error]
    while len(chain) < 8 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    return chain


def _no_space(path: Path, cause: BaseException) -> CheckpointError:
    """The one-line error of a full disk. A failed torch.save leaves its writer, and so the partial file,
    open in a reference cycle through the frames of `cause`'s chain: they are dropped and collected, so
    that the space of the removed partial folder comes back now."""
    for e in _chain(cause):
        e.__traceback__ = None
    gc.collect()
    error = CheckpointError(f"no space left on device writing {path}")
    error.errno = errno.ENOSPC
    return error


def _publish(tmp: Path, final: Path) -> None:
    """Make every file under `tmp` durable, then rename it to `final` (replacing an older one)."""
    for p in tmp.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)  # the old one stays whole until the new one is in place
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def save_pretrained_atomic(model, tokenizer, path: str | os.PathLike) -> str:
    """`save_pretrained` of the adapter (peft) or the full model, plus the tokenizer, written atomically.

    Returns "adapter" or "full". A kill mid-write leaves the previous `path` (or none), never a
    half-written one. CheckpointError on a full disk, with the partial folder removed. A `path` that
    is a symlink to a directory stays one: the directory it names is replaced.
    """
    final = Path(path)
    if final.is_symlink():
        check_directory(final)
        final = final.resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _publish(tmp, final)
    except Exception as e:
        if _out_of_space(e, final.parent):  # measured before the partial folder goes (finally)
            raise _no_space(final, e) from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left when something above failed
    return "adapter" if _holds_adapters(model) else "full"


def _fsync_dir(path: Path) -> None:
    fd = _open_dir(path)
    if fd is None:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def _candidates(root: Path) -> list[Path]:
    """step-* directories, newest first."""
    dirs = [p for p in root.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX):].isdigit()]
    return sorted(dirs, key=_step_of, reverse=True)


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """None if the checkpoint is complete and intact, else why not."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.exists():
        return "no manifest (partial write)"
    try:
        files = json.loads(manifest.read_bytes().decode("utf-8"))["files"]
        entries = [(name, int(meta["bytes"]), str(meta["sha256"])) for name, meta in files.items()]
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as e:
        # not UTF-8, not JSON, or not {"files": {name: {"bytes": n, "sha256": hex}}} (e.g. `[]`)
        return f"unreadable manifest ({type(e).__name__}: {e})"
    if not entries or "state.json" not in files:
        return "unreadable manifest (it lists no state.json)"
    for name, size, digest in entries:
        p = path / name
        if Path(name).name != name or not p.is_file():
            return f"missing {name}"
        if p.stat().st_size != size or _sha256(p) != digest:
            return f"{name} does not match its manifest"
    return None


def find_checkpoint(directory: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """(the newest complete checkpoint under `directory` or None, why each newer one was skipped).

    Reads manifests and hashes only; no weight is loaded. The checkpoint's `state.json` can then be
    read to compare a run's settings before `load_checkpoint`. A missing `directory` holds none;
    one that is a dangling symlink, not a directory or unreadable is a CheckpointError.
    """
    root = Path(directory)
    check_directory(root)
    if not root.exists():
        return None, []
    skipped = []
    for candidate in _candidates(root):
        problem = verify_checkpoint(candidate)
        if problem is None:
            return candidate, skipped
        skipped.append(f"skipping checkpoint {candidate}: {problem}")
    return None, skipped


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `directory`, skipping corrupt ones with a warning."""
    checkpoint, skipped = find_checkpoint(directory)
    for line in skipped:
        warn_user(line)
    return checkpoint


def load_checkpoint(path: str | os.PathLike, model, optimizer=None, scheduler=None,
                    restore_rng: bool = True) -> dict[str, Any]:
    """Restore model/optimizer/scheduler (and RNG) from a verified checkpoint; returns state.json."""
    path = Path(path)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} is not usable: {problem}")
    _load_model_state(model, load_file(str(path / "model.safetensors")))
    opt = torch.load(path / "optimizer.pt", weights_only=False, map_location="cpu")  # the optimizer moves it
    if optimizer is not None and opt["optimizer"] is not None:
        optimizer.load_state_dict(opt["optimizer"])
    if scheduler is not None and opt["scheduler"] is not None:
        scheduler.load_state_dict(opt["scheduler"])
    if restore_rng:
        set_rng_state(torch.load(path / "rng.pt", weights_only=False, map_location="cpu"))
    state = json.loads((path / "state.json").read_text())
    if (path / "extra.pt").exists():
        state["extra"] = torch.load(path / "extra.pt", weights_only=False, map_location="cpu")
    return state
