"""Rollouts as data: JSONL and Parquet files, and a streaming writer (records: `Rollout.to_dict()`).

    save_rollouts("step_12.jsonl", rollouts)          # or .parquet (one row per rollout)
    rollouts = load_rollouts("step_12.jsonl")
    with RolloutWriter("run/rollouts.jsonl") as w:    # append each step's rollouts as training goes
        w.write(rollouts)

Metadata must be JSON (an error names the key), except the live `env_state`, not saved unless asked.
A JSONL line torn by a writer stopped mid-line loads without that line, with a warning (`utils.jsonl`);
any other bad line is an error naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from SimpleTorchLLMRL.chat.message import SKIPPED_METADATA, Rollout, rollout_from_dict, rollout_to_dict
from SimpleTorchLLMRL.utils.jsonl import ends_mid_line, jsonl_records

# ---------------------------------------------------------------------- files


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(f"{path}: unknown rollout file type {suffix!r}; use .jsonl or .parquet")


def save_rollouts(path, rollouts: Iterable[Rollout], skip_metadata: Iterable[str] = SKIPPED_METADATA) -> Path:
    """Write rollouts to .jsonl (one per line) or .parquet (one row per rollout), atomically."""
    path = Path(path)
    records = [rollout_to_dict(r, skip_metadata) for r in rollouts]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    if _kind(path) == "jsonl":
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    else:
        _write_parquet(tmp, records)
    os.replace(tmp, path)
    return path


def load_rollouts(path) -> list[Rollout]:
    """Rollouts from a file written by `save_rollouts` or `RolloutWriter`."""
    path = Path(path)
    if _kind(path) == "parquet":
        unit, records = "row", enumerate(_read_parquet(path))
    else:
        unit, records = "line", jsonl_records(path.read_bytes(), str(path))
    out = []
    for n, record in records:
        try:
            out.append(rollout_from_dict(record))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: {unit} {n}: {e}") from e
    return out


class RolloutWriter:
    """Appends rollouts to a .jsonl file, one line each, written and fsynced at every `write`.

    A file that ends inside a line (a writer stopped mid-line) is continued on a new line,
    so the torn fragment stays a line of its own, which `load_rollouts` skips with a warning;
    so does a `write` that fails part way (a full disk): the next one starts a new line.
    """

    def __init__(self, path, skip_metadata: Iterable[str] = SKIPPED_METADATA):
        self.path = Path(path)
        if _kind(self.path) != "jsonl":
            raise ValueError(f"{self.path}: RolloutWriter appends to .jsonl files only")
        self.skip_metadata = tuple(skip_metadata)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (closed by close()); unbuffered: no half line kept
        self._mid_line = ends_mid_line(self.path)

    def write(self, rollouts: Iterable[Rollout]) -> None:
        lines = [json.dumps(rollout_to_dict(r, self.skip_metadata), ensure_ascii=False) + "\n" for r in rollouts]
        data = memoryview((b"\n" if self._mid_line else b"") + "".join(lines).encode("utf-8"))
        self._mid_line = True  # until the whole batch is on disk
        while data:
            data = data[self._file.write(data):]  # a regular file may take part of it
        os.fsync(self._file.fileno())
        self._mid_line = False

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RolloutWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------- Parquet (pyarrow, from the data extra)


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as e:
        raise ImportError("Parquet rollout files need pyarrow: uv sync --extra data") from e
    return pyarrow


_JSON_FIELDS = ("tool_calls", "sampling")  # message fields of free-form JSON: stored as JSON strings


def _message_type(pa):
    return pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string()),
                      ("trainable", pa.bool_()), ("token_ids", pa.list_(pa.int64())),
                      ("logprobs", pa.list_(pa.float64())), ("tool_calls", pa.string()),
                      ("tool_call_id", pa.string()), ("finish_reason", pa.string()),
                      ("temperature", pa.float64()), ("policy_version", pa.int64()), ("adapter", pa.string()),
                      ("sampling", pa.string())])


def _write_parquet(path: Path, records: list[dict]) -> None:
    pa = _pyarrow()
    rows = {"format_version": [r["format_version"] for r in records],
            "messages": [[dict(m, **{k: json.dumps(m[k]) if k in m else None for k in _JSON_FIELDS})
                          for m in r["messages"]] for r in records],
            "metadata": [json.dumps(r["metadata"], ensure_ascii=False) for r in records]}
    schema = pa.schema([("format_version", pa.int64()), ("messages", pa.list_(_message_type(pa))),
                        ("metadata", pa.string())])
    pa.parquet.write_table(pa.Table.from_pydict(rows, schema=schema), path)


def _read_parquet(path: Path) -> list[dict]:
    pa = _pyarrow()
    out = []
    for row in pa.parquet.read_table(path).to_pylist():
        messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
        for m in messages:
            for k in _JSON_FIELDS:
                if k in m:
                    m[k] = json.loads(m[k])
        out.append({"format_version": row["format_version"], "messages": messages,
                    "metadata": json.loads(row["metadata"])})
    return out
