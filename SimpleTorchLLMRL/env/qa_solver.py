"""`QASolverEnv`: one question, one answer, the final answer in `\\boxed{}` (score it with `BoxedReward`)."""

from __future__ import annotations

from SimpleTorchLLMRL.env.base import SingleTurnEnv

DEFAULT_QA_PROMPT = (
    "You are a helpful assistant. Solve the problem step by step, then give the final answer "
    "in \\boxed{}, for example \\boxed{42}."
)


class QASolverEnv(SingleTurnEnv):
    """Single turn: a system prompt asking for `\\boxed{}`, the question as the user turn, done after one reply.

    custom_sys_prompt: replaces the default system prompt; "" sends no system message.
    The episode state is {"answer": answer}.
    """

    max_turns = 1

    def __init__(self, custom_sys_prompt: str | None = None):
        if custom_sys_prompt is not None and not isinstance(custom_sys_prompt, str):
            raise ValueError(f"custom_sys_prompt must be a str or None, got {type(custom_sys_prompt).__name__}")
        super().__init__(DEFAULT_QA_PROMPT if custom_sys_prompt is None else custom_sys_prompt)
