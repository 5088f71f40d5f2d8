"""Atomic training checkpoints: write to a temp dir, verify, then rename.

A checkpoint directory `step-000123/` holds:
    model.safetensors   trainable state (the adapter only, for a peft model)
    optimizer.pt        optimizer (and scheduler) state
    rng.pt              Python, NumPy and torch RNG states
    state.json          step, data position and anything the caller adds
    extra.pt            more state the caller adds (a critic, a second optimizer), when given
    MANIFEST.json       size and sha256 of every file above, written last

`latest_checkpoint` returns the newest directory whose manifest verifies; a
corrupt or partial one is skipped with a warning, never loaded.

`save_pretrained_atomic` writes a `save_pretrained` directory (model or adapter,
and the tokenizer) the same way: complete under its name, or not there at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from SimpleTorchLLMRL.model.lora import is_peft_model
from SimpleTorchLLMRL.utils.warn import warn_user

PREFIX = "step-"
MANIFEST = "MANIFEST.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _model_state(model) -> dict[str, torch.Tensor]:
    if is_peft_model(model):
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model)
    else:
        state = model.state_dict()
    # safetensors refuses shared storage (tied embeddings): store independent contiguous copies.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def _load_model_state(model, state: dict[str, torch.Tensor]) -> None:
    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, state)
    else:
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as e:  # "size mismatch for ...": another architecture's weights
            detail = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e))
            raise ValueError(f"checkpoint does not fit the model: {detail}") from e
        if unexpected or [k for k in missing if k not in _tied_keys(model)]:
            raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")


def _tied_keys(model) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys if not isinstance(keys, dict) else keys.keys())


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
    critic or a second optimizer), given back by `load_checkpoint(...)["extra"]`.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    for stale in root.glob(f".tmp-{PREFIX}*"):  # left by a run killed mid-save: never complete, never loaded
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{PREFIX}{step:06d}-{os.getpid()}"
    tmp.mkdir()
    save_file(_model_state(model), str(tmp / "model.safetensors"))
    torch.save({"optimizer": optimizer.state_dict() if optimizer is not None else None,
                "scheduler": scheduler.state_dict() if scheduler is not None else None}, tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **(state or {})}, indent=1))
    if extra is not None:
        torch.save(extra, tmp / "extra.pt")
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir())}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
    _publish(tmp, final)
    if keep_last:
        for old in _candidates(root)[keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
    return final


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
    half-written one.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left when something above failed
    return "adapter" if is_peft_model(model) else "full"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _candidates(root: Path) -> list[Path]:
    """step-* directories, newest first."""
    dirs = [p for p in root.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX):].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


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
    read to compare a run's settings before `load_checkpoint`.
    """
    root = Path(directory)
    skipped = []
    for candidate in _candidates(root) if root.is_dir() else []:
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
