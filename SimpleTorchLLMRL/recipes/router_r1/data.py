"""Router-R1 data: question / gold-answer rows from jsonl or json files, sampled, length-filtered, batched.
A row is a dict with `data.prompt_key` (the question) and `data.answer_key` (a gold answer or a list of
them; the original's {"target": [...]} form works too).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt
from SimpleTorchLLMRL.recipes.router_r1.config import RouterDataConfig
from SimpleTorchLLMRL.utils.jsonl import read_jsonl
from SimpleTorchLLMRL.utils.warn import warn_user


@dataclass
class QARow:
    question: str
    answer: Any


def load_rows(paths: Sequence[str]) -> list[dict]:
    """Rows of jsonl (one object per line) or json (a list of objects) files, in order."""
    rows: list[dict] = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"data file {p} does not exist")
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, list):
                raise ValueError(f"{p}: a .json data file must hold a list of objects")
            rows += data
        else:
            rows += read_jsonl(path, torn_tail="error")
    return rows


def prepare_rows(rows: Sequence[dict], data: RouterDataConfig, num: int | None, seed: int, env=None,
                 tokenizer=None, split: str = "train") -> list[QARow]:
    """Check fields, sample `num` rows (seeded, as the original's `data.*_data_num`), and drop rows whose
    opening prompt is over `data.max_start_length` tokens (with a warning) when `env` and `tokenizer` are given."""
    out = []
    for i, row in enumerate(rows):
        missing = [k for k in (data.prompt_key, data.answer_key) if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{split} row {i} lacks the field(s) {missing} (data.prompt_key / data.answer_key); "
                             f"it has {sorted(row) if isinstance(row, dict) else type(row).__name__}")
        out.append(QARow(str(row[data.prompt_key]), row[data.answer_key]))
    if num is not None and num < len(out):
        out = random.Random(seed).sample(out, num)
    if env is not None and tokenizer is not None:
        kept = [r for r in out if len(encode_prompt(Rollout(env.setup(r.question)[0]), tokenizer))
                <= data.max_start_length]
        if len(kept) < len(out):
            warn_user(f"{split}: dropped {len(out) - len(kept)} of {len(out)} rows whose prompt is over "
                      f"data.max_start_length={data.max_start_length} tokens")
        out = kept
    return out


def batches(n_rows: int, batch_size: int, shuffle: bool, rng: random.Random, drop_last: bool = True) -> list[list[int]]:
    """Row indices per batch for one epoch (the original's DataLoader drops the last partial batch)."""
    order = list(range(n_rows))
    if shuffle:
        rng.shuffle(order)
    stop = n_rows - batch_size + 1 if drop_last else n_rows
    return [order[i: i + batch_size] for i in range(0, max(stop, 0), batch_size)]
