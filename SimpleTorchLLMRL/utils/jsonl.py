"""The one JSONL reader: metrics logs, datasets and rollout files all read through it.

    rows = read_jsonl("out/metrics.jsonl")                   # records, a torn last line dropped with a warning
    for line_no, record in jsonl_records(text, "data.jsonl", torn_tail="error"): ...

A torn line is what a writer killed mid-line leaves: the last line, without its
newline, that does not parse. Any other line that does not parse is an error
naming the source and the line; blank lines are skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from SimpleTorchLLMRL.utils.warn import warn_user

TORN_TAIL = ("warn", "skip", "error")


def jsonl_records(text: str, source: str, *, torn_tail: str = "warn") -> Iterator[tuple[int, Any]]:
    """(1-based line number, record) for each non-blank line of `text`."""
    if torn_tail not in TORN_TAIL:
        raise ValueError(f"torn_tail must be one of {TORN_TAIL}, got {torn_tail!r}")
    lines = text.split("\n")
    ends_clean = lines[-1] == ""
    if ends_clean:
        lines.pop()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) and not ends_clean and torn_tail != "error":
                if torn_tail == "warn":
                    warn_user(f"{source}: the last line is torn (a writer was stopped mid-line); skipped it")
                return
            raise ValueError(f"{source}: line {n} is not JSON ({e.msg})") from e
        yield n, record


def read_jsonl(path: str | os.PathLike, *, torn_tail: str = "warn") -> list[Any]:
    """The records of a JSONL file (see the module docstring for torn lines)."""
    text = Path(path).read_text(encoding="utf-8")
    return [record for _, record in jsonl_records(text, str(path), torn_tail=torn_tail)]
