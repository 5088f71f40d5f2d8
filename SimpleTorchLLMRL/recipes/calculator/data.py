"""Datasets for `main.py`: rows `{"question": str, "answer": str}`, a held-out split, and a seeded order.

    train, held_out = load_data(None, eval_size=200, seed=0)     # built-in synthetic arithmetic
    train, held_out = load_data("data.jsonl", eval_size=200, seed=0)
    train, held_out = load_data("rg:basic_arithmetic", eval_size=200, seed=0)   # a reasoning-gym task
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from SimpleTorchLLMRL.utils.jsonl import jsonl_records

REQUIRED_FIELDS = ("question", "answer")
SYNTHETIC_TRAIN_SIZE = 20000
RG_PREFIX = "rg:"  # --dataset rg:NAME: reasoning-gym's procedural task NAME
RG_TRAIN_SIZE = 2000  # its training rows (the held-out rows are drawn beside them)


class DatasetError(ValueError):
    """The dataset cannot be used (unreadable, wrong fields, empty); the message is one line."""


def read_rows(spec: str) -> list[dict]:
    """Rows of a .jsonl / .json / .parquet file, or of an HF datasets name ("name" or "name:split")."""
    path = Path(spec).expanduser()
    if path.is_dir():
        raise DatasetError(f"--dataset {spec}: is a directory; give a .jsonl, .json or .parquet file")
    if path.exists():
        suffix = path.suffix.lower()
        try:
            if suffix == ".parquet":
                return _read_parquet(path)
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DatasetError(f"--dataset {spec}: cannot read it: {e}") from e
        return _parse_json(text, spec, as_lines=suffix != ".json")
    if path.suffix.lower() in (".jsonl", ".json", ".parquet") or spec.startswith(("/", ".", "~")):
        raise DatasetError(f"--dataset {spec}: no such file")
    return _read_hf(spec)


def _parse_json(text: str, spec: str, as_lines: bool) -> list[dict]:
    if not as_lines:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"--dataset {spec}: not valid JSON ({e})") from e
        if isinstance(data, dict):  # {"question": [...], "answer": [...]} columns, or {"data": rows}
            data = data.get("data", data)
        if isinstance(data, dict):
            cols = {k: v for k, v in data.items() if isinstance(v, list)}
            if len({len(v) for v in cols.values()}) > 1:
                sizes = ", ".join(f"{k!r} has {len(v)}" for k, v in cols.items())
                raise DatasetError(f"--dataset {spec}: its columns differ in length ({sizes})")
            data = [dict(zip(cols, vals, strict=True)) for vals in zip(*cols.values(), strict=True)] if cols else []
        if not isinstance(data, list):
            raise DatasetError(f"--dataset {spec}: expected a list of objects")
        return data
    try:
        return [row for _, row in jsonl_records(text, f"--dataset {spec}", torn_tail="error")]
    except ValueError as e:
        raise DatasetError(str(e)) from e


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DatasetError(f"--dataset {path}: reading parquet needs pyarrow (`uv sync --extra data`)") from e
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001  (any reader failure is "unreadable")
        raise DatasetError(f"--dataset {path}: cannot read it as parquet: {str(e).splitlines()[0]}") from e


def _read_hf(spec: str) -> list[dict]:
    try:
        import datasets
    except ImportError as e:
        raise DatasetError(f"--dataset {spec}: no such file, and HF dataset names need the `datasets` package "
                           "(`uv sync --extra data`)") from e
    name, _, split = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # noqa: BLE001
        raise DatasetError(f"--dataset {spec}: cannot load it: {str(e).splitlines()[0] if str(e) else e!r}") from e
    return [dict(r) for r in ds]


def check_rows(rows: list, spec: str) -> list[dict]:
    """Rows with string question/answer; DatasetError naming the missing fields."""
    if not rows:
        raise DatasetError(f"--dataset {spec}: has no rows")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise DatasetError(f"--dataset {spec}: row {bad + 1} is not an object with fields {list(REQUIRED_FIELDS)}")
    for i, r in enumerate(rows):
        missing = [f for f in REQUIRED_FIELDS if r.get(f) is None]
        if missing:
            raise DatasetError(f"--dataset {spec}: row {i + 1} lacks the field(s) {missing}; every row needs "
                               f"{' and '.join(repr(f) for f in REQUIRED_FIELDS)}")
    return [{"question": str(r["question"]), "answer": str(r["answer"])} for r in rows]


@functools.lru_cache(maxsize=2)
def rg_task(spec: str, size: int, seed: int):
    """(rows, reward) of `--dataset rg:NAME` (`integrations.reasoning_gym.task`), made once per (spec, size, seed)."""
    from SimpleTorchLLMRL.integrations import reasoning_gym

    name = spec[len(RG_PREFIX):]
    try:
        return reasoning_gym.task(name, size=size, seed=seed)
    except (ImportError, ValueError) as e:
        raise DatasetError(f"--dataset {spec}: {str(e).splitlines()[0]}") from e


def rg_size(eval_size: int) -> int:
    """Rows drawn from a reasoning-gym task: the training rows and as many as are held out."""
    return RG_TRAIN_SIZE + eval_size


def load_data(spec: str | None, eval_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows). Synthetic: disjoint hash splits; a file: `eval_size` rows held out."""
    if spec is None:
        from SimpleTorchLLMRL.recipes.calculator.arithmetic import build_dataset

        return (build_dataset(SYNTHETIC_TRAIN_SIZE, seed=seed, split="train"),
                build_dataset(eval_size, seed=seed + 1, split="test"))
    rows = check_rows(rg_task(spec, rg_size(eval_size), seed)[0] if spec.startswith(RG_PREFIX) else read_rows(spec),
                      spec)
    if len(rows) < 2:
        raise DatasetError(f"--dataset {spec}: needs at least 2 rows (training and held-out), has {len(rows)}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = min(eval_size, len(rows) // 5 or 1)  # never more than a fifth of a small file
    held = sorted(order[:n_eval])
    train = sorted(order[n_eval:])
    return [rows[i] for i in train], [rows[i] for i in held]


def check_prompt_lengths(rows: list[dict], prompt_length, budget: int, context: int | None, spec: str | None,
                         question_length=None) -> None:
    """DatasetError naming the first row whose prompt plus `budget` new tokens overflows `context`.

    prompt_length(question) -> exact prompt tokens. question_length(questions) -> a cheap token
    count of each question (one batched tokenizer call): the prompt's overhead is measured once and
    only rows within a margin of the limit are measured exactly, so 20,000 rows cost well under a second.
    """
    if context is None or not rows:
        return
    questions = [r["question"] for r in rows]
    candidates = range(len(rows))
    if question_length is not None:
        cheap = question_length(questions)
        overhead = prompt_length(questions[0]) - cheap[0]
        margin = 16  # tokenization at the template's seams may differ by a few tokens
        candidates = [i for i, n in enumerate(cheap) if n + overhead + budget > context - margin]
    for i in candidates:
        n = prompt_length(questions[i])
        if n + budget > context:
            q = questions[i] if len(questions[i]) <= 40 else questions[i][:37] + "..."
            raise DatasetError(f"--dataset {spec or '(synthetic)'}: the question {q!r} makes a prompt of {n} "
                               f"tokens; with --max-new-tokens {budget} that is over the model's context of "
                               f"{context} tokens (drop or shorten that row, or lower --max-new-tokens)")


def check_context(rows: list[dict], env, tokenizer, model, max_new_tokens: int, spec: str | None) -> None:
    """Every row's first prompt (system prompt, tools, question) plus `max_new_tokens` fits the model's
    context: checked at load, not when the row's batch comes up mid-run."""
    from SimpleTorchLLMRL.chat.message import Rollout
    from SimpleTorchLLMRL.chat.tokenize import encode_prompt

    tools = getattr(env, "tools", None)

    def prompt_length(question: str) -> int:
        msgs, _ = env.setup(question, None)
        return len(encode_prompt(Rollout(list(msgs), {"tools": tools} if tools is not None else {}), tokenizer))

    def question_length(questions: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(questions, add_special_tokens=False)["input_ids"]]

    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    check_prompt_lengths(rows, prompt_length, max_new_tokens, context, spec, question_length)
