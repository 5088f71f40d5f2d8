"""Metrics logging to the console, a jsonl file and (optionally) Weights & Biases.

    logger = MetricsLogger(output_dir, use_wandb=False, config=vars(args))
    logger.log(step, {"reward/mean": 0.4, "loss": 0.1})
    logger.close()

wandb is imported only when asked for; without a login it runs offline, so a
run never blocks on the network.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _plain(value: Any) -> Any:
    """Tensors and numpy scalars -> Python numbers, so every value is JSON."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (math.inf if value > 0 else -math.inf)
    return value


def _has_wandb_login() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


class MetricsLogger:
    """Writes each `log(step, metrics)` to `metrics.jsonl`, the console and W&B."""

    def __init__(self, output_dir: str | os.PathLike | None = None, *, use_wandb: bool = False,
                 project: str = "SimpleTorchLLMRL", run_name: str | None = None,
                 config: Mapping[str, Any] | None = None, console: bool = True, append: bool = False):
        self.console = console
        self._file = None
        if output_dir is not None:
            path = Path(output_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a" if append else "w", encoding="utf-8")
        self._wandb_run = None
        if use_wandb:
            try:
                import wandb
            except ImportError as e:  # pragma: no cover - wandb is a runtime dependency
                raise ImportError("wandb logging needs the wandb package: uv sync") from e
            mode = os.environ.get("WANDB_MODE") or ("online" if _has_wandb_login() else "offline")
            self._wandb_run = wandb.init(project=project, name=run_name, config=dict(config or {}), mode=mode,
                                         dir=str(output_dir) if output_dir else None)

    def log(self, step: int, metrics: Mapping[str, Any], *, prefix: str = "") -> dict[str, Any]:
        row = {f"{prefix}{k}": _plain(v) for k, v in metrics.items()}
        if self._file is not None:
            self._file.write(json.dumps({"step": step, **row}) + "\n")
            self._file.flush()
        if self.console:
            shown = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
            _write_console(f"[step {step}] {shown}")
        if self._wandb_run is not None:
            self._wandb_run.log(row, step=step)
        return row

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _write_console(line: str) -> None:
    try:
        from tqdm import tqdm

        tqdm.write(line)
    except ImportError:  # pragma: no cover
        print(line, flush=True)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl file (a torn last line, from a killed run, is skipped)."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
