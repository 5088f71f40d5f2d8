"""Metrics logging to the console, a jsonl file and (optionally) Weights & Biases; the one JSONL reader.

    logger = MetricsLogger(output_dir, use_wandb=False, config=vars(args))
    logger.log(step, {"reward/mean": 0.4, "loss": 0.1})
    logger.close()
    rows = read_metrics(output_dir / "metrics.jsonl")

wandb is imported only when asked for; without a login it runs offline, so a run never blocks on the network.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from SimpleTorchLLMRL.utils.jsonl import ends_mid_line, read_jsonl


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
                 config: Mapping[str, Any] | None = None, console: bool = True, append: bool = False,
                 console_keys: Iterable[str] | None = None, console_prefix: str = "",
                 print_fn: Callable[[str], None] | None = None, wandb_mode: str | None = None,
                 run_id: str | None = None):
        """console_keys: show only metrics whose last "/" part is one of these (None: all);
        print_fn: where console lines go (default: tqdm.write); wandb_mode: "online", "offline"
        or "disabled" (default: $WANDB_MODE, else online with a login and offline without);
        run_id: the W&B run to continue (`wandb.init(id=run_id, resume="allow")`), e.g. the
        `wandb_run_id` of the logger of the run being resumed."""
        self.console = console
        self.console_keys = None if console_keys is None else frozenset(console_keys)
        self.console_prefix, self.print_fn = console_prefix, print_fn or _write_console
        self.history: list[dict[str, Any]] = []
        self._file = None
        if output_dir is not None:
            path = Path(output_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            torn = append and path.exists() and ends_mid_line(path)  # a run cut mid-line: start a new one
            self._file = open(path, "a" if append else "w", encoding="utf-8")
            if torn:
                self._file.write("\n")
        self._wandb_run = None
        if use_wandb:
            import wandb
            mode = wandb_mode or os.environ.get("WANDB_MODE") or ("online" if _has_wandb_login() else "offline")
            same_run = {"id": run_id, "resume": "allow"} if run_id else {}
            self._wandb_run = wandb.init(project=project, name=run_name, config=dict(config or {}), mode=mode,
                                         dir=str(output_dir) if output_dir else None, **same_run)

    @property
    def wandb_run_id(self) -> str | None:
        """The W&B run's id (store it to resume the same run), None without W&B."""
        return getattr(self._wandb_run, "id", None)

    def log(self, step: int, metrics: Mapping[str, Any], *, prefix: str = "") -> dict[str, Any]:
        row = {f"{prefix}{k}": _plain(v) for k, v in metrics.items()}
        if self._file is not None:
            self._file.write(json.dumps({"step": step, **row}) + "\n")
            self._file.flush()
        self.history.append({"step": step, **row})
        if self.console:
            shown = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                              if self.console_keys is None or k.split("/")[-1] in self.console_keys)
            self.print_fn(f"{self.console_prefix}[step {step}] {shown}")
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
    from tqdm import tqdm  # a dependency: console lines do not break its progress bars

    tqdm.write(line)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl file (a torn last line, from a killed run, is skipped)."""
    return read_jsonl(path, torn_tail="skip")
