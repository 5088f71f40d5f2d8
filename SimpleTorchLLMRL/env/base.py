"""The environment protocol that `collect_rollouts` drives.

An Env turns a dataset row into the opening messages of a rollout and answers each MODEL turn with zero or
more messages (tool results, feedback) until it says the episode is done. `state` is the Env's own per-episode
object: it is kept in `rollout.metadata["env_state"]` and never inspected by the library.
"""

from __future__ import annotations

from typing import Any

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout


class Env:
    """Base class; subclasses implement `setup` and `step` (and may override `reward`).

    `tools`: JSON tool schemas (OpenAI function format) that the chat template
    should show the model; `collect_rollouts` copies them into
    `rollout.metadata["tools"]`. `stop_strings`: where a MODEL turn should end so the env can act (e.g.
    "</tool_call>"); pass them to the generator as `ModelGenerate(..., tool_call_stop=env.stop_strings)`.
    """

    tools: list[dict] | None = None
    stop_strings: list[str] | None = None
    max_turns: int | None = None

    def setup(self, question: Any, answer: Any = None) -> tuple[list[Message], Any]:
        """Opening messages (system / user) and a fresh per-episode state."""
        raise NotImplementedError

    def step(self, rollout: Rollout, state: Any) -> tuple[list[Message], bool]:
        """React to the last MODEL turn: (messages to append, episode done?)."""
        raise NotImplementedError

    def reward(self, rollout: Rollout, state: Any) -> float | None:
        """Optional per-episode reward; None means "use an external reward function".

        `collect_rollouts` calls it once per finished episode (whatever ended it) and keeps a number in
        `rollout.metadata["reward"]` (`episode_rewards` reads them back as a (B,) tensor). An env that scores
        a whole batch at once (a `score(rollouts)` method, as `CodeEnv`) is left to its caller instead.
        """
        return None

    def close(self, state: Any) -> None:
        """Release what `setup` acquired for the episode (a connection, a session): called once per
        episode by `collect_rollouts`, after `reward`, however the episode ended."""
        return None


class SingleTurnEnv(Env):
    """Ask once, finish after the first MODEL turn."""

    def __init__(self, system_prompt: str | None = None):
        self.system_prompt = system_prompt

    def setup(self, question, answer=None):
        msgs = [Message(self.system_prompt, MessageType.SYSTEM)] if self.system_prompt else []
        msgs.append(Message(str(question), MessageType.MESSAGE))
        return msgs, {"answer": answer}

    def step(self, rollout, state):
        return [], True
