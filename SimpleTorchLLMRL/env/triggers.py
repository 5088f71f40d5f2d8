"""Triggers: interrupt generation when the text so far matches, append text, resume.

    trigger = CodeTrigger(PythonSandbox(timeout=5))
    trigger.trigger("Let me check.\\n```python\\nprint(6 * 7)\\n```\\n")
    # '\\n<Code Result>\\n42\\n</Code Result>\\n'

Generation stops at `trigger.stop_strings` (ModelGenerate's `tool_call_stop=`); `TriggerEnv` makes a
trigger an `Env`, so `collect_rollouts` appends its text as a TOOL message and the next turn resumes.
"""

from __future__ import annotations

import copy as _copy
from dataclasses import dataclass
from typing import Any

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.env.base import Env
from SimpleTorchLLMRL.tools.parsers import CodeBlockParser, LastClosedBlock
from SimpleTorchLLMRL.tools.sandbox import PythonSandbox


class Trigger:
    """Base class: `trigger(text) -> str | None` and `copy()`.

    name:         the TOOL message name `TriggerEnv` gives the appended text
    stop_strings: where a generator should pause so the trigger can look at the text
    """

    name: str = "trigger"
    stop_strings: tuple[str, ...] = ()

    def trigger(self, text: str) -> str | None:
        raise NotImplementedError

    def copy(self) -> Trigger:
        """An independent trigger for a new episode (a shallow copy; override if state is nested)."""
        return _copy.copy(self)

    def __call__(self, text: str) -> str | None:
        return self.trigger(text)


class NoneTrigger(Trigger):
    """Never fires: plain generation."""

    name = "none"

    def trigger(self, text: str) -> str | None:
        return None


class CodeTrigger(Trigger):
    """Runs a ```python block that the text ends with and appends `<Code Result>...</Code Result>`.

    Fires only when the last closed python block ends the text (trailing whitespace
    aside), so a block is run once: after the result is appended it no longer ends
    the text. `max_calls` bounds the executions per episode (then it stops firing).
    """

    name = "python"
    stop_strings = ("```\n",)

    def __init__(self, sandbox: PythonSandbox | None = None, max_calls: int | None = None,
                 tag: str = "Code Result"):
        if max_calls is not None and (isinstance(max_calls, bool) or not isinstance(max_calls, int)
                                      or max_calls < 1):
            raise ValueError(f"CodeTrigger max_calls must be an int >= 1 or None, got {max_calls!r}")
        self.sandbox = sandbox if sandbox is not None else PythonSandbox()
        self.max_calls, self.tag, self.calls = max_calls, tag, 0
        self._blocks = LastClosedBlock(CodeBlockParser())

    def pending_code(self, text: str) -> str | None:
        """The code of the closed python block that ends `text`, if any.

        Incremental: on a text that extends the previous call's, only the new part is scanned.
        """
        return self._blocks.code_at_end(text)

    def trigger(self, text: str) -> str | None:
        code = self.pending_code(text)
        if code is None or (self.max_calls is not None and self.calls >= self.max_calls):
            return None
        self.calls += 1
        return f"\n<{self.tag}>\n{self.sandbox.run(code).to_text()}\n</{self.tag}>\n"

    def copy(self) -> CodeTrigger:
        """Same sandbox and settings, call count reset."""
        new = _copy.copy(self)
        new.calls = 0
        new._blocks = LastClosedBlock(CodeBlockParser())
        return new


@dataclass
class TriggerEpisode:
    """Per-episode state of `TriggerEnv`: its own trigger copy, MODEL turns seen, times it fired."""

    trigger: Trigger
    answer: Any = None
    turns: int = 0
    fired: int = 0


class TriggerEnv(Env):
    """A Trigger as an Env: step feeds the last MODEL message's text to the trigger.

    The trigger's text comes back as a TOOL message (named `trigger.name`); None ends
    the episode, as does reaching `max_turns` MODEL turns.
    """

    def __init__(self, trigger: Trigger, custom_sys_prompt: str | None = None, max_turns: int = 4):
        if not isinstance(trigger, Trigger):
            raise ValueError(f"TriggerEnv needs a Trigger, got {type(trigger).__name__}")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"TriggerEnv max_turns must be an int >= 1, got {max_turns!r}")
        self.trigger, self.max_turns = trigger, max_turns
        self.system_prompt = custom_sys_prompt
        self.stop_strings = list(trigger.stop_strings)

    def setup(self, question: Any, answer: Any = None) -> tuple[list[Message], TriggerEpisode]:
        msgs = [Message(self.system_prompt, MessageType.SYSTEM)] if self.system_prompt else []
        msgs.append(Message(str(question), MessageType.MESSAGE))
        return msgs, TriggerEpisode(self.trigger.copy(), answer)

    def step(self, rollout: Rollout, state: TriggerEpisode) -> tuple[list[Message], bool]:
        if not len(rollout) or rollout[-1].type is not MessageType.MODEL:
            return [], True
        state.turns += 1
        if state.turns >= self.max_turns:
            return [], True
        text = state.trigger.trigger(rollout[-1].content)
        if text is None:
            return [], True
        state.fired += 1
        return [Message(text, MessageType.TOOL, name=state.trigger.name)], False
