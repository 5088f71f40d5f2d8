"""`ToolRegistry`: named tools, their schemas, call parsing and concurrent, fail-safe execution.

    registry = ToolRegistry([calculator], formats=("json", "tags"))
    tokenizer.apply_chat_template(chat, tools=registry.schemas, ...)
    calls = registry.parse(model_message)          # list[ToolCall]
    tool_messages = registry.execute(calls)        # list[Message], type TOOL, name = tool name

`execute` never raises for what a model can write: every failure (bad JSON, unknown tool, wrong arguments, a
raising or timed-out tool) is a TOOL message saying so. Calls run concurrently, one daemon thread each; a
timed-out call is abandoned, not killed (tools that may hang for good run in a process, as the sandbox does).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from SimpleTorchLLMRL.chat.message import Message, MessageType
from SimpleTorchLLMRL.tools.base import Tool, ToolArgumentError
from SimpleTorchLLMRL.tools.parsers import (
    CodeBlockParser,
    JsonToolCallParser,
    TagToolCallParser,
    ToolCall,
    ToolCallParser,
    calls_from_openai,
    parse_tool_calls,
)

FORMATS = ("json", "tags", "python")


@dataclass
class ToolResult:
    """The outcome of one call. `ok` is False for every kind of failure."""

    name: str | None
    content: str
    ok: bool
    seconds: float = 0.0

    def to_message(self) -> Message:
        return Message(self.content, MessageType.TOOL, name=self.name)


class ToolRegistry:
    """Tools by name.

    tools:            Tool objects or plain typed, docstringed functions (wrapped with `Tool`)
    formats:          call formats `parse` looks for: "json" (<tool_call>), "tags" (<name>body</name>
                      for every registered tool), "python" (```python blocks -> the "python" tool)
    parsers:          extra parser objects with `parse(text) -> list[ToolCall]`
    timeout:          seconds per call unless the tool sets its own `timeout`
    max_calls:        calls run per `execute`; further calls are answered with one error message
    max_output_chars: longer results are cut, with a note saying how much was dropped
    """

    def __init__(self, tools: Iterable[Tool | Callable] = (), *, formats: Sequence[str] = ("json",),
                 parsers: Sequence[ToolCallParser] = (), timeout: float = 30.0, max_calls: int = 16,
                 max_output_chars: int = 8000):
        if isinstance(formats, str):
            formats = (formats,)
        bad = [f for f in formats if f not in FORMATS]
        if bad:
            raise ValueError(f"ToolRegistry formats must be among {FORMATS}, got {bad}")
        if not timeout > 0:
            raise ValueError(f"ToolRegistry timeout must be a positive number of seconds, got {timeout!r}")
        if not (isinstance(max_calls, int) and max_calls >= 1):
            raise ValueError(f"ToolRegistry max_calls must be an int >= 1, got {max_calls!r}")
        if not (isinstance(max_output_chars, int) and max_output_chars >= 1):
            raise ValueError(f"ToolRegistry max_output_chars must be an int >= 1, got {max_output_chars!r}")
        self.formats = tuple(formats)
        self.extra_parsers = list(parsers)
        self.timeout, self.max_calls, self.max_output_chars = timeout, max_calls, max_output_chars
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.register(t)

    # ---- the tools ---------------------------------------------------------------------------------
    def register(self, t: Tool | Callable) -> Tool:
        """Add a tool (a plain function is wrapped); a name already taken raises ValueError."""
        t = t if isinstance(t, Tool) else Tool(t)
        if t.name in self._tools:
            raise ValueError(f"a tool named {t.name!r} is already registered; tool names must be unique")
        self._tools[t.name] = t
        return t

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    @property
    def schemas(self) -> list[dict]:
        """JSON schemas for `apply_chat_template(tools=...)`, in registration order."""
        return [t.schema for t in self._tools.values()]

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self):
        return iter(self._tools.values())

    def __repr__(self) -> str:
        return f"ToolRegistry({self.names}, formats={self.formats})"

    # ---- parsing ------------------------------------------------------------------------------------
    @property
    def parsers(self) -> list[ToolCallParser]:
        out: list[ToolCallParser] = []
        if "json" in self.formats:
            out.append(JsonToolCallParser())
        if "tags" in self.formats:
            out.append(TagToolCallParser(self.names))
        if "python" in self.formats:
            out.append(CodeBlockParser(tool_name="python"))
        return out + self.extra_parsers

    def parse(self, message: Message | str) -> list[ToolCall]:
        """Calls in a MODEL message (its structured `tool_calls` if set, else its text) or a string."""
        if isinstance(message, Message):
            if message.tool_calls:
                return calls_from_openai(message.tool_calls)
            message = message.content
        if not isinstance(message, str):
            raise TypeError(f"ToolRegistry.parse takes a Message or a str, got {type(message).__name__}")
        return parse_tool_calls(message, self.parsers)

    # ---- execution ----------------------------------------------------------------------------------
    def _prepare(self, call: ToolCall) -> tuple[Tool, dict] | ToolResult:
        """The tool and checked arguments, or a failed ToolResult saying why."""
        if call.error is not None:
            return ToolResult(call.name, f"Error: {call.error}", ok=False)
        if call.name not in self._tools:
            return ToolResult(call.name, f"Error: unknown tool {call.name!r}; available tools: "
                                         f"{', '.join(self.names) or 'none'}", ok=False)
        t = self._tools[call.name]
        try:
            args = t.bind_text(call.text) if call.arguments is None else call.arguments
            return t, t.check_arguments(args)
        except Exception as e:  # noqa: BLE001 - ToolArgumentError, or odd objects in structured calls
            return ToolResult(t.name, f"Error: invalid arguments for tool {t.name!r}: {e}", ok=False)

    def execute_detailed(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run the calls concurrently; one ToolResult per call, in order (plus one for dropped calls)."""
        calls = list(calls)
        run, dropped = calls[: self.max_calls], calls[self.max_calls:]
        prepared = [self._prepare(c) for c in run]
        results: list[ToolResult | None] = [p if isinstance(p, ToolResult) else None for p in prepared]
        threads: list[tuple[int, threading.Thread, float, float]] = []
        for i, p in enumerate(prepared):
            if isinstance(p, ToolResult):
                continue
            t, args = p
            th = threading.Thread(target=self._run_one, args=(t, args, results, i), daemon=True,
                                  name=f"tool-{t.name}")
            th.start()
            threads.append((i, th, time.monotonic(), t.timeout or self.timeout))
        for i, th, started, limit in threads:
            th.join(max(0.0, started + limit - time.monotonic()))
            if th.is_alive() or results[i] is None:
                name = prepared[i][0].name
                results[i] = ToolResult(name, f"Error: tool {name!r} timed out after {limit:g} s", ok=False,
                                        seconds=time.monotonic() - started)
        if dropped:
            results.append(ToolResult(None, f"Error: too many tool calls in one turn; only the first "
                                            f"{self.max_calls} were run, {len(dropped)} ignored", ok=False))
        return list(results)  # a copy: an abandoned (timed-out) thread may still write into `results`

    def _run_one(self, t: Tool, args: dict, results: list, i: int) -> None:
        start = time.monotonic()
        try:
            content, ok = t.run(args), True
        except ToolArgumentError as e:
            content, ok = f"Error: invalid arguments for tool {t.name!r}: {e}", False
        except BaseException as e:  # noqa: BLE001 - a tool must never take the episode down
            content, ok = f"Error: tool {t.name!r} raised {type(e).__name__}: {e}", False
        if not isinstance(content, str):
            content = str(content)
        limit = self.max_output_chars
        if len(content) > limit:
            content = content[:limit] + f"\n[... {len(content) - limit} more characters truncated]"
        results[i] = ToolResult(t.name, content, ok, seconds=time.monotonic() - start)

    def execute(self, calls: Sequence[ToolCall]) -> list[Message]:
        """TOOL messages (name = tool name), one per call; never raises for bad calls."""
        return [r.to_message() for r in self.execute_detailed(calls)]

    def __call__(self, message: Message | str) -> list[Message]:
        """parse + execute."""
        return self.execute(self.parse(message))

    def describe(self) -> str:
        """A plain-text list of the tools, for prompts of templates that cannot render `tools=`."""
        return "\n".join(json.dumps(s, ensure_ascii=False) for s in self.schemas)


def as_registry(tools: ToolRegistry | Iterable[Any] | None, **kwargs: Any) -> ToolRegistry:
    """A ToolRegistry from a registry (returned as is), or from tools / functions."""
    if isinstance(tools, ToolRegistry):
        return tools
    return ToolRegistry(tools or (), **kwargs)
