"""An OpenEnv environment server as an `Env` for `collect_rollouts` (the `openenv` extra).

    from SimpleTorchLLMRL import collect_rollouts
    from SimpleTorchLLMRL.env import episode_rewards
    from SimpleTorchLLMRL.integrations.openenv import OpenEnvEnv

    env = OpenEnvEnv("http://127.0.0.1:8000", action="answer", observe="question")
    rollouts = collect_rollouts(generator, env, questions=[{"seed": s} for s in range(8)], group_size=4)
    loss = grpo.calculate_loss(rollouts, episode_rewards(rollouts))

Each episode holds one WebSocket session with the server (OpenEnv's `EnvClient`): `reset` then every
`step` reach the same environment instance. (The server's stateless HTTP `/reset` and `/step` build a
fresh instance per request, so a step never sees the episode its reset began: a correct answer is
scored against no question.) The first observation is the user's message; each later one answers the
model's move as environment output (a TOOL message). The episode's reward is the sum of the rewards its steps returned
(`Env.reward`, which `collect_rollouts` records); the session is closed when the episode ends.

A question is what `reset` gets: a dict of its keyword arguments, an int seed, or None.

OpenEnv 0.10.0 needs mcp<2 (the dev group and vLLM need mcp>=2): it lives in an environment of its own
(`integrations_envs/openenv/`, docs/environments.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.env.base import Env
from SimpleTorchLLMRL.integrations._extras import require

OBSERVATION_KEYS = ("prompt", "question", "message", "text", "observation")  # read in this order by default


@dataclass
class Episode:
    """One episode's session: the connected client, each step's reward, the last result."""

    client: Any
    rewards: list[float | None] = field(default_factory=list)
    done: bool = False


class OpenEnvEnv(Env):
    """An OpenEnv server at `base_url`, one WebSocket session per episode (module docstring).

    action: the model's text -> the step's action: a key (`"answer"` sends `{"answer": text}`) or a
    function (for a typed client, one returning its Action). observe: the observation -> the text the
    model reads: a key, or a function; default the first of OBSERVATION_KEYS it holds, else its JSON.
    client: the EnvClient class (default OpenEnv's GenericEnvClient, plain dicts). system_prompt: the
    episode's first message. max_turns: MODEL turns per episode (collect_rollouts' default otherwise).
    """

    def __init__(self, base_url: str, *, action: str | Callable[[str], Any] = "message",
                 observe: str | Callable[[Any], str] | None = None, client=None, system_prompt: str | None = None,
                 max_turns: int | None = None, timeout: float = 60.0):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"base_url must be the server's http(s):// or ws(s):// URL, got {base_url!r}")
        if not (callable(action) or (isinstance(action, str) and action)):
            raise TypeError(f"action must be a key or a function text -> action, got {action!r}")
        if observe is not None and not (callable(observe) or (isinstance(observe, str) and observe)):
            raise TypeError(f"observe must be a key or a function observation -> text, got {observe!r}")
        self.base_url, self.action, self.observe, self.client = base_url, action, observe, client
        self.system_prompt, self.max_turns, self.timeout = system_prompt, max_turns, timeout

    def _connect(self):
        if self.client is None:
            self.client = require("openenv", "openenv").GenericEnvClient
        client = self.client(base_url=self.base_url, message_timeout_s=self.timeout).sync()
        client.connect()
        return client

    def setup(self, question: Any, answer: Any = None) -> tuple[list[Message], Episode]:
        episode = Episode(self._connect())
        try:
            result = episode.client.reset(**_reset_arguments(question))
        except BaseException:
            episode.client.close()
            raise
        episode.done = bool(result.done)
        msgs = [Message(self.system_prompt, MessageType.SYSTEM)] if self.system_prompt else []
        return msgs + [Message(self.text(result.observation))], episode

    def step(self, rollout: Rollout, state: Episode) -> tuple[list[Message], bool]:
        if state.done:  # the server ended the episode at reset: nothing to act on
            return [], True
        text = rollout.last(MessageType.MODEL).content
        act = self.action(text) if callable(self.action) else {self.action: text}
        result = state.client.step(act)
        state.rewards.append(None if result.reward is None else float(result.reward))
        state.done = bool(result.done)
        return ([], True) if state.done else ([Message(self.text(result.observation), MessageType.TOOL)], False)

    def reward(self, rollout: Rollout, state: Episode) -> float | None:
        """The sum of the rewards the episode's steps returned; None when the server gave none."""
        given = [r for r in state.rewards if r is not None]
        return sum(given) if given else None

    def close(self, state: Episode) -> None:
        state.client.close()

    def text(self, observation: Any) -> str:
        """What the model reads of an observation (`observe`)."""
        if callable(self.observe):
            return str(self.observe(observation))
        fields = observation if isinstance(observation, dict) else getattr(observation, "__dict__", {})
        if isinstance(self.observe, str):
            if self.observe not in fields:
                raise KeyError(f"the observation has no {self.observe!r} (it has {sorted(fields)})")
            return str(fields[self.observe])
        key = next((k for k in OBSERVATION_KEYS if isinstance(fields.get(k), str)), None)
        return fields[key] if key is not None else json.dumps(fields, default=str)


def _reset_arguments(question: Any) -> dict:
    if question is None:
        return {}
    if isinstance(question, dict):
        return dict(question)
    if isinstance(question, int) and not isinstance(question, bool):
        return {"seed": question}
    raise TypeError(f"an OpenEnv question is reset's arguments: a dict, an int seed or None; got "
                    f"{type(question).__name__}")
