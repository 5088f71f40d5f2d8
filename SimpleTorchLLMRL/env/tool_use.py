"""`ToolUseEnv`: multi-turn question answering with tools.

    env = ToolUseEnv([calculator], max_turns=4)
    gen = ModelGenerate(model, tok, tool_call_stop=env.stop_strings)
    rollouts = collect_rollouts(gen, env, questions, answers, group_size=8)

Each MODEL turn's calls run (`ToolRegistry`) and come back as TOOL messages (never trained); the episode
ends after a turn without a call, or after `max_turns`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.env.base import Env
from SimpleTorchLLMRL.tools.registry import ToolRegistry, as_registry

_FORMAT_HINTS = {
    "json": 'To call a tool, write <tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}'
            "</tool_call>.",
    "tags": "To call a tool, write <tool name>input</tool name>, for example <{name}>...</{name}>.",
    "python": "To run Python, write a ```python code block; what it prints comes back to you.",
}
_STOPS = {"json": "</tool_call>", "python": "```\n"}


def default_tool_prompt(registry: ToolRegistry) -> str:
    """A system prompt naming the tools and the call formats the registry parses."""
    names = registry.names
    first = names[0] if names else "tool"
    lines = ["You are a helpful assistant that can use tools."]
    if names:
        lines.append(f"Available tools: {', '.join(names)}.")
    lines += [_FORMAT_HINTS[f].replace("{name}", first) for f in registry.formats]
    lines.append("The result of each call comes back in the next message. When you know the answer, "
                 "give it in \\boxed{}, for example \\boxed{42}.")
    return " ".join(lines)


@dataclass
class ToolEpisode:
    """Per-episode state: the answer, MODEL turns seen, calls per tool name, failed calls."""

    answer: Any = None
    turns: int = 0
    tool_calls: dict[str, int] = field(default_factory=dict)
    tool_errors: int = 0

    @property
    def num_tool_calls(self) -> int:
        return sum(self.tool_calls.values())


def tool_stats(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Per-rollout means of the `ToolEpisode` states `collect_rollouts` left in `metadata["env_state"]`.

    tool/call_rate: rollouts with at least one call; tool/calls: calls; tool/errors: failed calls.
    """
    episodes = [r.metadata["env_state"] for r in rollouts]
    n = max(1, len(episodes))
    return {
        "tool/call_rate": sum(e.num_tool_calls > 0 for e in episodes) / n,
        "tool/calls": sum(e.num_tool_calls for e in episodes) / n,
        "tool/errors": sum(e.tool_errors for e in episodes) / n,
    }


class ToolUseEnv(Env):
    """Tools as an environment.

    tools:             a ToolRegistry, or Tools / typed functions to register
    custom_sys_prompt: replaces the default prompt (which names the tools and the call format); "" for none
    max_turns:         MODEL turns per episode (the last turn's calls are not run)
    formats:           call formats to parse, when `tools` is not already a registry
    timeout:           seconds per tool call, when `tools` is not already a registry
    describe_tools:    also list the JSON schemas in the system prompt (for chat templates that
                       ignore `tools=`, e.g. plain or Llama-3-style templates without tool support)
    expose_schemas:    set `tools` (the schemas the chat template renders); False for envs whose
                       calls are not JSON function calls
    """

    def __init__(self, tools: ToolRegistry | Iterable[Any], custom_sys_prompt: str | None = None,
                 max_turns: int = 4, *, formats: Sequence[str] = ("json",), timeout: float = 30.0,
                 describe_tools: bool = False, expose_schemas: bool = True):
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"ToolUseEnv max_turns must be an int >= 1, got {max_turns!r}")
        if custom_sys_prompt is not None and not isinstance(custom_sys_prompt, str):
            raise ValueError(f"custom_sys_prompt must be a str or None, got {type(custom_sys_prompt).__name__}")
        self.registry = as_registry(tools, formats=formats, timeout=timeout)
        self.max_turns = max_turns
        self.tools = self.registry.schemas if expose_schemas and len(self.registry) else None
        prompt = default_tool_prompt(self.registry) if custom_sys_prompt is None else custom_sys_prompt
        if describe_tools and len(self.registry):
            prompt = (prompt + "\n\n" if prompt else "") + "Tools (JSON schemas):\n" + self.registry.describe()
        self.system_prompt = prompt
        # stop strings that end a turn at a finished call: pass as ModelGenerate(tool_call_stop=...)
        self.stop_strings = [_STOPS[f] for f in self.registry.formats if f in _STOPS]
        if "tags" in self.registry.formats:
            self.stop_strings += [f"</{n}>" for n in self.registry.names]

    def setup(self, question: Any, answer: Any = None) -> tuple[list[Message], ToolEpisode]:
        msgs = [Message(self.system_prompt, MessageType.SYSTEM)] if self.system_prompt else []
        msgs.append(Message(str(question), MessageType.MESSAGE))
        return msgs, ToolEpisode(answer=answer)

    def step(self, rollout: Rollout, state: ToolEpisode) -> tuple[list[Message], bool]:
        if not len(rollout) or rollout[-1].type is not MessageType.MODEL:
            return [], True  # nothing new to react to
        state.turns += 1
        if state.turns >= self.max_turns:
            return [], True  # no turn is left to read the results
        calls = self.registry.parse(rollout[-1])
        if not calls:
            return [], True
        results = self.registry.execute_detailed(calls)
        for r in results:
            key = r.name if r.name is not None else "<invalid>"
            state.tool_calls[key] = state.tool_calls.get(key, 0) + 1
            state.tool_errors += not r.ok
        return [r.to_message() for r in results], False
