"""Find tool calls in model text. Each format is a small parser with `parse(text) -> list[ToolCall]`.

    JsonToolCallParser    <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>
    TagToolCallParser     <calculator>2+3</calculator>, <search>who wrote Hamlet</search>
    CodeBlockParser       ```python\\nprint(2+3)\\n```

Parsers never raise on model text: a call they cannot read comes back with `error` set. `parse_tool_calls`
runs several and returns their calls in text order, dropping a call inside another one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    """One call found in model text.

    name:      the tool name (None when the call is unreadable)
    arguments: JSON arguments (None for a bare-text call)
    text:      the bare body of a tag / code-block call, bound to the tool's text argument
    error:     why the call cannot be run (a message for the model), None when it is well formed
    span:      (start, end) character offsets of the call in the parsed text
    """

    name: str | None
    arguments: dict[str, Any] | None = None
    text: str | None = None
    error: str | None = None
    span: tuple[int, int] = field(default=(0, 0), compare=False)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI / chat-template form: {"type": "function", "function": {"name", "arguments"}}."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments or {}}}


class ToolCallParser(Protocol):
    def parse(self, text: str) -> list[ToolCall]: ...


def _call_from_object(obj: Any, span: tuple[int, int]) -> ToolCall:
    """A decoded JSON value -> ToolCall (with `error` when it is not a call)."""
    if not isinstance(obj, dict):
        return ToolCall(None, error=f"a tool call must be a JSON object with 'name' and 'arguments', got {obj!r:.80}",
                        span=span)
    if "name" not in obj and isinstance(obj.get("function"), dict):  # OpenAI {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, error="the tool call has no 'name' string", span=span)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI encodes arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as e:
            return ToolCall(name, error=f"the arguments of {name!r} are not valid JSON: {e}", span=span)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name, error=f"the arguments of {name!r} must be a JSON object, got {type(args).__name__}",
                        span=span)
    return ToolCall(name, arguments=args, span=span)


def _decode_all(body: str) -> list[Any]:
    """Every JSON value in `body` (whitespace-separated); raises ValueError on anything else."""
    s = body.strip()
    if s.startswith("```"):  # a fenced ```json block inside the tags
        s = s.split("\n", 1)[1] if "\n" in s else ""
        s = s[: s.rfind("```")] if s.rstrip().endswith("```") else s
    values, i = [], 0
    while True:
        while i < len(s) and s[i].isspace():
            i += 1
        if i >= len(s):
            break
        value, i = _DECODER.raw_decode(s, i)
        values.append(value)
    if not values:
        raise ValueError("empty tool call")
    return values


def calls_from_json(body: str, span: tuple[int, int] = (0, 0)) -> list[ToolCall]:
    """Tool calls from a JSON text: one object, several objects, or a list of objects."""
    try:
        values = _decode_all(body)
    except (ValueError, RecursionError) as e:
        return [ToolCall(None, error=f"malformed tool call JSON: {e}", span=span)]
    calls = []
    for v in values:
        for obj in v if isinstance(v, list) and v else [v]:
            calls.append(_call_from_object(obj, span))
    return calls


class JsonToolCallParser:
    """JSON inside `<tool_call>...</tool_call>` (Hermes / Qwen2.5 / Qwen3).

    allow_unclosed: a final `<tool_call>` without its closing tag (a generator that
    dropped the stop string) still counts when its body is valid JSON.
    """

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>", allow_unclosed: bool = True):
        if not open_tag or not close_tag:
            raise ValueError("JsonToolCallParser open_tag and close_tag must be non-empty strings")
        self.open_tag, self.close_tag, self.allow_unclosed = open_tag, close_tag, allow_unclosed

    def parse(self, text: str) -> list[ToolCall]:
        calls, pos = [], 0
        while (i := text.find(self.open_tag, pos)) >= 0:
            start = i + len(self.open_tag)
            j = text.find(self.close_tag, start)
            if j < 0:
                if self.allow_unclosed:
                    found = calls_from_json(text[start:], (i, len(text)))
                    if not any(c.error for c in found):
                        calls.extend(found)
                break
            calls.extend(calls_from_json(text[start:j], (i, j + len(self.close_tag))))
            pos = j + len(self.close_tag)
        return calls


class TagToolCallParser:
    """`<name>body</name>` for each name in `tags`: a call of tool `name` with the stripped body as text."""

    def __init__(self, tags: Iterable[str], allow_unclosed: bool = False):
        self.tags = sorted(set(tags), key=len, reverse=True)
        for t in self.tags:
            if not re.fullmatch(r"[A-Za-z_][\w.\-]*", t):
                raise ValueError(f"TagToolCallParser tag names must look like identifiers, got {t!r}")
        self.allow_unclosed = allow_unclosed
        self._open = re.compile("<(" + "|".join(map(re.escape, self.tags)) + ")>") if self.tags else None

    def parse(self, text: str) -> list[ToolCall]:
        calls, pos = [], 0
        while self._open is not None and (m := self._open.search(text, pos)):
            name = m.group(1)
            close = f"</{name}>"
            j = text.find(close, m.end())
            if j < 0:
                if self.allow_unclosed:
                    calls.append(ToolCall(name, text=text[m.end():].strip(), span=(m.start(), len(text))))
                break
            calls.append(ToolCall(name, text=text[m.end(): j].strip(), span=(m.start(), j + len(close))))
            pos = j + len(close)
        return calls


class CodeBlockParser:
    """Fenced code blocks (```python ... ```) as calls of `tool_name` with the code as text."""

    def __init__(self, languages: Sequence[str] = ("python", "py"), tool_name: str = "python",
                 allow_unclosed: bool = False):
        if not languages:
            raise ValueError("CodeBlockParser languages must name at least one fence language, e.g. ('python',)")
        self.tool_name, self.allow_unclosed = tool_name, allow_unclosed
        langs = "|".join(map(re.escape, sorted(languages, key=len, reverse=True)))
        self._open = re.compile(rf"```[ \t]*(?:{langs})[ \t]*\r?\n", re.IGNORECASE)

    def parse(self, text: str) -> list[ToolCall]:
        calls, pos = [], 0
        while m := self._open.search(text, pos):
            j = text.find("```", m.end())
            if j < 0:
                if self.allow_unclosed:
                    calls.append(ToolCall(self.tool_name, text=clean_code(text[m.end():]), span=(m.start(), len(text))))
                break
            calls.append(ToolCall(self.tool_name, text=clean_code(text[m.end(): j]), span=(m.start(), j + 3)))
            pos = j + 3
        return calls


def clean_code(code: str) -> str:
    """Drop leading blank lines and trailing whitespace; keep indentation. Linear in len(code)."""
    lines = code.split("\n")
    first = 0
    while first < len(lines) and not lines[first].strip():
        first += 1
    return "\n".join(lines[first:]).rstrip()


_TRAILING_SPACE = re.compile(r"\s*")


class LastClosedBlock:
    """The last closed block `CodeBlockParser.parse` would find, kept up to date as a text grows.

        tracker = LastClosedBlock(CodeBlockParser())
        tracker.code_at_end(text)   # the block's code when it ends `text` (whitespace aside), else None

    Each call scans only what was appended since the previous call (a text that is not an extension of the
    previous one is scanned from the start), so calling it at every step of a growing generation costs time
    linear in the final length. An opener's match ends at the first newline after it, so an opener search that
    failed is final for every start before the text's last newline.
    """

    def __init__(self, parser: CodeBlockParser):
        self._open = parser._open
        # (text, pos, search_from, pending opener (start, end) or None, close_from, last block (body_start, body_end, end))
        self._state: tuple = ("", 0, 0, None, 0, None)

    def _advance(self, text: str) -> tuple:
        prev, pos, search_from, pending, close_from, last = self._state
        if not text.startswith(prev):
            pos, search_from, pending, close_from, last = 0, 0, None, 0, None
        while True:
            if pending is None:
                m = self._open.search(text, max(pos, search_from))
                if m is None:
                    search_from = max(pos, text.rfind("\n") - 2)
                    break
                pending, close_from = (m.start(), m.end()), m.end()
            j = text.find("```", close_from)
            if j < 0:
                close_from = max(pending[1], len(text) - 2)  # a fence may straddle the end
                break
            last, pos, pending = (pending[1], j, j + 3), j + 3, None
            search_from = pos
        state = (text, pos, search_from, pending, close_from, last)
        self._state = state  # one assignment: a racing caller sees the old or the new state, both valid
        return state

    def code_at_end(self, text: str) -> str | None:
        last = self._advance(text)[5]
        if last is None or _TRAILING_SPACE.fullmatch(text, last[2]) is None:
            return None
        return clean_code(text[last[0]: last[1]])


def calls_from_openai(tool_calls: Sequence[Any]) -> list[ToolCall]:
    """Structured calls (a Message's `tool_calls`, e.g. from a server-side tool parser)."""
    return [_call_from_object(tc, (0, 0)) for tc in tool_calls]


def parse_tool_calls(text: str, parsers: Sequence[ToolCallParser]) -> list[ToolCall]:
    """All parsers' calls in text order; a call inside an earlier call's span is dropped."""
    found = sorted((c for p in parsers for c in p.parse(text)), key=lambda c: (c.span[0], -c.span[1]))
    out: list[ToolCall] = []
    for c in found:
        if out and c.span[0] < out[-1].span[1] and c.span != out[-1].span:
            continue  # inside the previous call (calls of one JSON block share its span and are kept)
        out.append(c)
    return out


def format_json_call(name: str, arguments: dict[str, Any]) -> str:
    """The Hermes / Qwen text of one call: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"
