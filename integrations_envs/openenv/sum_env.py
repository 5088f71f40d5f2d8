"""A small OpenEnv environment for the tests: add two numbers (from the reset's seed), with a calculator.

A step's text that calls the calculator (`<tool_call>{"name": "calculator", "arguments": {"expression":
"a + b"}}</tool_call>`) gets the result back; one with a `\\boxed{}` answer ends the episode, paying 1 when it
is this instance's sum, else 0; anything else is told to answer. At most three steps. The answer is checked
against the question this instance asked at reset, so an episode must keep one instance (a session).
"""

import json
import re
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app

MAX_STEPS = 3


class SumAction(Action):
    answer: str


class SumObservation(Observation):
    question: str = ""
    feedback: str = ""


def calculate(text: str) -> str | None:
    """The result of a calculator call "a + b" / "a - b" / "a * b" in `text`, or None."""
    call = re.search(r"<tool_call>(.*?)</tool_call>", text, re.S)
    try:
        expression = json.loads(call.group(1))["arguments"]["expression"]
        a, op, b = re.fullmatch(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*", expression).groups()
    except (AttributeError, TypeError, KeyError, ValueError):
        return None
    return str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])


class SumEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    live: set = set()  # the instances the server has not closed yet (an ended session closes its own)

    def __init__(self):
        super().__init__()
        self.answer, self._state = None, State()
        SumEnvironment.live.add(id(self))

    def close(self) -> None:
        SumEnvironment.live.discard(id(self))

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SumObservation:
        seed = seed or 0
        a, b = 10 + seed % 40, 20 + 3 * seed % 50
        self.answer, self._state = str(a + b), State(episode_id=episode_id)
        return SumObservation(question=f"What is {a} + {b}?")

    def step(self, action: SumAction, timeout_s: float | None = None, **kwargs: Any) -> SumObservation:
        self._state.step_count += 1
        boxed = re.findall(r"\\boxed\{([^{}]*)\}", action.answer)
        if boxed:
            right = self.answer is not None and boxed[-1].strip() == self.answer
            return SumObservation(done=True, reward=float(right))
        if self._state.step_count >= MAX_STEPS:
            return SumObservation(done=True, reward=0.0)
        result = calculate(action.answer)
        return SumObservation(feedback=result if result is not None else "Answer in \\boxed{}.", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def make_app():
    return create_app(SumEnvironment, SumAction, SumObservation, env_name="sum", max_concurrent_envs=64)
