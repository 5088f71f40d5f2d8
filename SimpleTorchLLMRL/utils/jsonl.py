"""The one JSONL reader: metrics logs, datasets and rollout files all read through it.

    rows = read_jsonl("out/metrics.jsonl")                   # records, torn lines dropped with a warning
    for line_no, record in jsonl_records(text, "data.jsonl", torn_tail="error"): ...

A torn line is what a writer stopped mid-line leaves: the last line without its newline that does not
parse (or is not UTF-8), or a line that is a JSON document cut short (`cut_short`) followed by more lines
(a later writer started on a new line after it). Any other bad line is an error naming the source and the
line; blank lines are skipped. Given bytes, each line is decoded on its own.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from SimpleTorchLLMRL.utils.warn import warn_user

TORN_TAIL = ("warn", "skip", "error")

_BARE_TAIL = re.compile(r"[-+.\w]*\Z")  # a number or literal that runs to the end of the text
_NUMBER_START = re.compile(r"-?(?:(?:0|[1-9]\d*)(?:\.\d*)?(?:(?<=\d)[eE][-+]?\d*)?)?")  # a JSON number, cut
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_ESCAPE_START = re.compile(r"u[0-9a-fA-F]{0,4}\Z")  # a \uXXXX escape at the end (the decoder wants more after it)


def cut_short(text: str) -> bool:
    """Is `text` the beginning of a JSON document cut off before its end (not a whole one, not a wrong one)?

    The decoder's first error must be the end of the text: an open string, a missing value,
    name or delimiter after the last character, or a number, literal or `\\uXXXX` escape
    cut in the middle. Anything else (`{not json`, `{"a" 1`, a document then more) is not.
    """
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg.startswith("Unterminated string") or e.pos == len(text) and not e.msg.startswith("Extra data"):
            return True  # the decoder only says "unterminated" when a string runs to the end of the text
        if e.msg.startswith("Invalid \\uXXXX escape"):
            return _ESCAPE_START.match(text, e.pos) is not None
        tail = _BARE_TAIL.search(text)
        token = tail.group()
        if e.msg.startswith("Expecting value") and e.pos == tail.start():  # tr, nul, -Inf, -
            return _NUMBER_START.fullmatch(token) is not None or any(lit.startswith(token) for lit in _LITERALS)
        if e.msg.startswith("Expecting ',' delimiter") and tail.start() < e.pos:  # 1. 1e 1.5e+ (the rest of a number)
            return _NUMBER_START.fullmatch(token) is not None
        return False
    return False  # a whole document


def _line_text(raw: str | bytes) -> tuple[str | None, bool]:
    """(text, ends mid-character): the line decoded as UTF-8; text None when it is not UTF-8."""
    if isinstance(raw, str):
        return raw, False
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError as e:
        if e.reason == "unexpected end of data" and e.end == len(raw):
            return raw[: e.start].decode("utf-8"), True  # the first error is the end: all before it decodes
        return None, False


def jsonl_records(data: str | bytes, source: str, *, torn_tail: str = "warn") -> Iterator[tuple[int, Any]]:
    """(1-based line number, record) for each non-blank line of `data` (bytes: UTF-8, line by line).

    torn_tail: what a torn line gets (see the module docstring): "warn" (skipped, with a
    warning), "skip" (skipped silently) or "error".
    """
    if torn_tail not in TORN_TAIL:
        raise ValueError(f"torn_tail must be one of {TORN_TAIL}, got {torn_tail!r}")
    lines = data.split(b"\n" if isinstance(data, bytes) else "\n")
    ends_clean = not lines[-1]
    if ends_clean:
        lines.pop()
    last_record = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    for n, raw in enumerate(lines, 1):
        text, mid_character = _line_text(raw)
        if text is not None and not mid_character:
            if not text.strip():
                continue
            try:
                yield n, json.loads(text)
                continue
            except json.JSONDecodeError as e:
                problem = f"is not JSON ({e.msg})"
        else:
            problem = "is not UTF-8" if text is None else "ends inside a UTF-8 character"
        tail = n == len(lines) and not ends_clean
        fragment = n < last_record and text is not None and cut_short(text)
        if not (tail or fragment) or torn_tail == "error":
            raise ValueError(f"{source}: line {n} {problem}")
        if torn_tail == "warn":
            warn_user(f"{source}: the last line is torn (a writer was stopped mid-line); skipped it" if tail else
                      f"{source}: line {n} is torn (a writer was stopped mid-line, a later one went on after it); "
                      f"skipped it")


def read_jsonl(path: str | os.PathLike, *, torn_tail: str = "warn") -> list[Any]:
    """The records of a JSONL file (see the module docstring for torn lines)."""
    data = Path(path).read_bytes()
    return [record for _, record in jsonl_records(data, str(path), torn_tail=torn_tail)]


def ends_mid_line(path: str | os.PathLike) -> bool:
    """Does the file end inside a line (no newline after its last byte)? False for an empty file."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"
