r"""`BoxedReward`: is the answer boxed in the final MODEL message the right answer?

Legend: B batch.

    reward = BoxedReward()                          # 1.0 correct, 0.0 otherwise
    rewards = reward(rollouts, ["\\frac{1}{2}", "42"])   # (B,) float32

Equivalence is `reward.math.math_equal`. The answer is every box of the message, distinct ones read as one
list (`\boxed{17} or \boxed{18}` is a wrong list, not a lucky guess); a ground truth may be a full
solution (its last run of adjacent boxes, or the text after GSM8K's `####`). See docs/rewards.md.
"""

from __future__ import annotations

from typing import Any

from SimpleTorchLLMRL.chat.message import Message, Rollout
from SimpleTorchLLMRL.reward.base import Reward, answers_of, check_finite
from SimpleTorchLLMRL.reward.math import boxed_answer, math_equal


def gold_answer(ground_truth: Any) -> str | None:
    r"""The answer inside a ground truth: its last boxes (adjacent ones: one list), the text after `####`, or itself."""
    if ground_truth is None:
        return None
    if isinstance(ground_truth, float) and ground_truth.is_integer():
        ground_truth = int(ground_truth)
    text = str(ground_truth).strip()
    boxed = boxed_answer(text, all_boxes=False)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text


class BoxedReward(Reward):
    r"""Score the `\boxed{}` answer of each rollout's final MODEL message against its ground truth.

    correct / incorrect / no_answer: the values for a matching box, a wrong box, and no (or an empty) box
    or no MODEL message. `use_math_verify`: None = when installed, True = required, False = never.
    A ground truth may be a list of acceptable answers; a missing one is refused before anything is
    scored (`answers_of`). `timeout`: seconds math-verify may spend on one answer.
    """

    name = "boxed"
    needs_ground_truth = True

    def __init__(self, correct: float = 1.0, incorrect: float = 0.0, no_answer: float = 0.0,
                 use_math_verify: bool | None = None, rel_tol: float = 1e-9, timeout: float = 5.0):
        self.correct = check_finite("correct", correct)
        self.incorrect = check_finite("incorrect", incorrect)
        self.no_answer = check_finite("no_answer", no_answer)
        if use_math_verify not in (None, True, False):
            raise ValueError(f"use_math_verify must be None, True or False, got {use_math_verify!r}")
        if use_math_verify is True:
            from SimpleTorchLLMRL.reward.math import _import_math_verify

            _import_math_verify()  # fail at construction, not in the middle of training
        self.use_math_verify = use_math_verify
        if not (0.0 <= rel_tol < 1.0):
            raise ValueError(f"rel_tol must be in [0, 1), got {rel_tol!r}")
        self.rel_tol = float(rel_tol)
        if not (isinstance(timeout, (int, float)) and 0 < timeout <= 15):
            raise ValueError(f"timeout must be a number of seconds in (0, 15], got {timeout!r}")
        self.timeout = float(timeout)

    @property
    def failure_value(self) -> float:
        return self.no_answer

    @staticmethod
    def extract(text: str | None) -> str | None:
        r"""The answer this reward reads from `text`: its complete boxes, distinct ones as a list (None if none)."""
        return boxed_answer(text)

    def is_correct(self, prediction: str | None, ground_truth: Any) -> bool:
        golds = answers_of(ground_truth)
        return any(
            math_equal(prediction, gold_answer(g), use_math_verify=self.use_math_verify, rel_tol=self.rel_tol,
                       timeout=self.timeout)
            for g in golds
        )

    def score(self, message: Message, ground_truth: Any, rollout: Rollout) -> float:
        prediction = self.extract(message.content)
        if prediction is None:
            return self.no_answer
        return self.correct if self.is_correct(prediction, ground_truth) else self.incorrect
