"""Resuming `main.py`: what a resumed run must share with the run it continues, compared before any weight loads.

    ckpt, saved = resume_point(out, args, model)   # UsageError (one line) when the run cannot be continued
    if ckpt is not None:
        load_checkpoint(ckpt, model, optimizer, scheduler)   # only after every comparison passed
    save_checkpoint(..., state=checkpoint_state(args, model, step, wandb_run_id))

Refused, nothing written (exit 2): a flag that shapes the weights (`WEIGHT_FLAGS`, then the model's config)
or the run (`RUN_FLAGS`) differs, --steps below the checkpoint's, every checkpoint corrupt, a bad metrics line.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from SimpleTorchLLMRL.recipes.calculator.cli import UsageError
from SimpleTorchLLMRL.utils.checkpoint import CheckpointError, find_checkpoint
from SimpleTorchLLMRL.utils.jsonl import read_jsonl
from SimpleTorchLLMRL.utils.warn import warn_user

# What the checkpoint's weights are (their names, shapes and meaning): compared before anything else.
WEIGHT_FLAGS = ("model", "lora", "qlora", "lora_rank", "lora_alpha", "dtype")
# What the run trains on and how (--steps may grow).
RUN_FLAGS = ("dataset", "reward", "batch_size", "group_size", "lr", "seed", "temperature", "max_new_tokens", "max_turns",
             "warmup_steps", "micro_batch_size")
# config.json entries that say nothing about the weights
_NOT_ARCHITECTURE = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "_commit_hash",
                     "_attn_implementation", "_attn_implementation_autoset", "attn_implementation"}


def model_config(model) -> dict[str, Any]:
    """The model's config as JSON values, without the entries that do not shape the weights."""
    config = getattr(model, "config", None)
    raw = config.to_dict() if hasattr(config, "to_dict") else {}
    plain = json.loads(json.dumps(raw, sort_keys=True, default=str))
    return {k: v for k, v in plain.items() if k not in _NOT_ARCHITECTURE}


def checkpoint_state(args: argparse.Namespace, model, step: int, wandb_run_id: str | None) -> dict[str, Any]:
    """What state.json holds beside the step: the data position, every flag, the architecture, the W&B run."""
    return {"data_position": step * args.batch_size, "args": vars(args), "model_config": model_config(model),
            "wandb_run_id": wandb_run_id}


def resume_point(out: Path, args: argparse.Namespace, model) -> tuple[Path | None, dict[str, Any] | None]:
    """(checkpoint, its state.json) to continue from, (None, None) to start at step 0; UsageError otherwise.
    Reads only the manifests, state.json and metrics.jsonl."""
    if not args.resume:
        return None, None
    root = out / "checkpoints"
    try:
        ckpt, skipped = find_checkpoint(root)  # the newest complete one; why each newer one was skipped
    except CheckpointError as e:  # a dangling symlink, not a directory, unreadable
        raise UsageError(f"--resume: {e}; nothing was changed") from e
    if ckpt is None:
        if skipped:
            raise UsageError(f"--resume: every checkpoint in {root} is corrupt ({skipped[0]}); nothing was "
                             "changed. Pass --restart instead of --resume to start over from step 0")
        check_metrics(out)
        return None, None
    saved = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))  # verified by find_checkpoint
    before, now = saved.get("args", {}), vars(args)
    adapter = before.get("lora") or before.get("qlora")  # the LoRA flags shape only an adapter's weights
    _compare([n for n in WEIGHT_FLAGS if adapter or not n.startswith("lora_")], before, now, ckpt, "the weights")
    if "model_config" in saved:
        then, current = saved["model_config"], model_config(model)
        diff = sorted(k for k in set(then) | set(current) if then.get(k) != current.get(k))
        if diff:
            shown = ", ".join(f"{k} {then.get(k)!r} -> {current.get(k)!r}" for k in diff[:3])
            raise UsageError(f"--resume: --model {args.model} is not the architecture of the checkpointed run "
                             f"({ckpt}): {shown}")
    _compare(RUN_FLAGS, before, now, ckpt, "the run")
    if saved["step"] > args.steps:
        raise UsageError(f"--resume: --steps {args.steps} is below the checkpoint's step {saved['step']} ({ckpt}); "
                         f"pass --steps {saved['step']} or more")
    if not check_metrics(out) and saved["step"] > 0:
        warn_user(f"--resume: {out / 'metrics.jsonl'} is missing; the curves and summary will lack the steps "
                  f"before {saved['step']}")
    for line in skipped:
        warn_user(line)
    return ckpt, saved


def _compare(names, before: dict, now: dict, ckpt: Path, what: str) -> None:
    for name in names:
        if name in before and before[name] != now[name]:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"--resume: {flag} is {now[name]!r} but the checkpointed run ({ckpt}) used "
                             f"{before[name]!r}; every flag that shapes {what} must match")


def check_metrics(out: Path) -> bool:
    """Whether metrics.jsonl exists; UsageError when a line other than a torn last one does not parse."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return False
    try:
        read_jsonl(path, torn_tail="skip")
    except (ValueError, OSError) as e:  # UnicodeDecodeError is a ValueError
        raise UsageError(f"--resume: {e}; nothing was changed (fix or delete that line, or pass --restart)") from e
    return True


def start_over(out: Path) -> None:
    """--restart: empty the run's checkpoints/ and final/ (a symlinked one keeps its link); metrics.jsonl is
    rewritten by the new run. UsageError naming what could not be deleted."""
    for name in ("checkpoints", "final"):
        path = out / name
        try:
            if path.is_symlink():
                for child in path.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    else:
                        child.unlink()
            elif path.exists():
                shutil.rmtree(path)
        except OSError as e:
            raise UsageError(f"--restart: cannot delete {e.filename or path}: {e.strerror or e}") from e
