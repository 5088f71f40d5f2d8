"""The reward protocol: `reward(rollouts, ground_truths) -> torch.Tensor` of shape (B,), float32.

Legend: B batch (number of rollouts).

A reward reads each rollout's final MODEL message; a rollout without one scores the failure value, never
raises. A reward that needs ground truths refuses a missing one (None, NaN, pandas NA, blank, an empty
list: `answers_of`) before scoring anything. `Reward` is a convenience base (`score(message, ground_truth,
rollout)` per rollout); any callable with the batched signature works wherever a reward is expected.
"""

from __future__ import annotations

import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout


def final_model_message(rollout: Rollout) -> Message | None:
    """The last MODEL message of `rollout`, or None when the model never spoke."""
    if not isinstance(rollout, Rollout):
        raise TypeError(f"expected a Rollout, got {type(rollout).__name__}")
    return rollout.last(MessageType.MODEL)


def check_batch(rollouts: Sequence[Rollout], ground_truths: Sequence[Any] | None) -> list[Any]:
    """Ground truths as a list aligned with `rollouts` (all None when not given)."""
    if isinstance(rollouts, Rollout):
        raise TypeError("a reward takes a list of Rollouts, got a single Rollout; wrap it: [rollout]")
    n = len(rollouts)
    if ground_truths is None:
        return [None] * n
    if isinstance(ground_truths, str):
        raise TypeError("ground_truths must be a sequence with one entry per rollout, got a single str")
    gts = list(ground_truths)
    if len(gts) != n:
        raise ValueError(f"got {n} rollouts but {len(gts)} ground_truths; they must have the same length")
    return gts


def missing_reason(value: Any) -> str | None:
    """Why `value` is no answer at all (None, NaN, pandas NA / NaT, blank text), or None when it is one.

    A NaN is any number unequal to itself (float, numpy, Decimal); a string is never NaN:
    "nan" is text a model can be asked to write.
    """
    if value is None:
        return "None"
    if isinstance(value, str):
        return None if value.strip() else f"a blank string {value!r}"
    if isinstance(value, numbers.Number) and value != value:
        return f"NaN ({type(value).__name__}; pandas reads an empty cell as NaN)"
    pd = sys.modules.get("pandas")  # a pandas NA exists only once pandas is imported
    if pd is not None and (value is pd.NA or value is pd.NaT):
        return f"pandas {value!r} (a missing value)"
    return None


def answers_of(ground_truth: Any, row: int | None = None) -> list[Any]:
    """The acceptable answers one ground truth gives (a list or tuple of them, or one answer).

    ValueError, naming `row` (the index in the batch) and what is wrong, when it is missing
    (see `missing_reason`), is an empty list, or holds a missing answer.
    """
    where = "a ground truth" if row is None else f"the ground truth of row {row}"
    if hasattr(ground_truth, "tolist") and not isinstance(ground_truth, (str, bytes, numbers.Number)):
        ground_truth = ground_truth.tolist()  # a numpy array of answers (a list cell of a parquet file)
    if isinstance(ground_truth, (list, tuple)):
        if not ground_truth:
            raise ValueError(f"{where} is missing: it is an empty list; give at least one acceptable answer")
        for k, answer in enumerate(ground_truth):
            reason = missing_reason(answer)
            if reason is not None:
                raise ValueError(f"{where} is missing: answer {k} of its list is {reason}; "
                                 f"every rollout needs its answer, got {ground_truth!r}")
        return list(ground_truth)
    reason = missing_reason(ground_truth)
    if reason is not None:
        raise ValueError(f"{where} is missing: it is {reason}; every rollout needs its answer")
    return [ground_truth]


def as_reward_tensor(values: Sequence[float]) -> torch.Tensor:
    """(B,) float32 tensor from Python floats."""
    return torch.tensor([float(v) for v in values], dtype=torch.float32)  # (B,)


def check_finite(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


class Reward:
    """Base class. `__call__(rollouts, ground_truths) -> (B,) float32` via per-rollout `score`.

    `failure_value` is returned for a rollout with no MODEL message. With `needs_ground_truth`
    every row's ground truth is checked (`answers_of`) before any rollout is scored.
    """

    name: str = "reward"
    failure_value: float = 0.0
    needs_ground_truth: bool = False

    def score(self, message: Message, ground_truth: Any, rollout: Rollout) -> float:
        raise NotImplementedError

    def __call__(self, rollouts: Sequence[Rollout], ground_truths: Sequence[Any] | None = None) -> torch.Tensor:
        gts = check_batch(rollouts, ground_truths)
        if self.needs_ground_truth:
            if ground_truths is None:
                raise ValueError(f"the {self.name} reward needs ground_truths, one answer per rollout; got None")
            for row, gt in enumerate(gts):
                answers_of(gt, row)
        out = []
        for rollout, gt in zip(rollouts, gts, strict=True):
            msg = final_model_message(rollout)
            out.append(self.failure_value if msg is None else self.score(msg, gt, rollout))
        return as_reward_tensor(out)  # (B,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FunctionReward(Reward):
    """Wrap `fn(text, ground_truth) -> float` (text = final MODEL message content) as a batched reward.

        reward = FunctionReward(lambda text, gt: float(gt in text), name="contains")
    """

    def __init__(self, fn: Callable[[str, Any], float], name: str | None = None, failure_value: float = 0.0):
        if not callable(fn):
            raise TypeError(f"FunctionReward fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "function")
        self.failure_value = check_finite("failure_value", failure_value)

    def score(self, message, ground_truth, rollout):
        return float(self.fn(message.content, ground_truth))


_LITERAL = r"(?:[^\\.^$*+?{}\[\]|()]|\\[^A-Za-z0-9])+"  # plain characters and escaped punctuation
_TAGGED = re.compile(rf"^(?P<open>{_LITERAL})\((?P<body>\.\*\?|\.\+\?|\[\\s\\S\]\*\?)\)(?P<close>{_LITERAL})$")


def _literal_tags(extract: str) -> tuple[str, str, int] | None:
    """(open, close, least body length) for a pattern `OPEN(.*?)CLOSE` with literal ends, else None."""
    m = _TAGGED.match(extract)
    if m is None:
        return None
    open_tag, close_tag = (re.sub(r"\\(.)", r"\1", m.group(end)) for end in ("open", "close"))
    return open_tag, close_tag, 1 if m.group("body") == ".+?" else 0


def _between_tags(open_tag: str, close_tag: str, least: int) -> Callable[[str], str | None]:
    """The regex `OPEN(.*?)CLOSE`'s last match (as `re.finditer` finds them), in linear time.

    A backtracking regex retries `.*?` from every unclosed OPEN to the end of the text:
    quadratic on a long completion full of OPENs. Each `str.find` here moves forward instead.
    """

    def from_tags(text: str) -> str | None:
        found, pos = None, 0
        while True:
            start = text.find(open_tag, pos)
            if start < 0:
                return found
            body = start + len(open_tag)
            end = text.find(close_tag, body + least)
            if end < 0:
                return found  # no CLOSE after this OPEN, so none after any later OPEN either
            found, pos = text[body:end], end + len(close_tag)

    return from_tags


def make_extractor(extract: str | Callable[[str], str | None] | None) -> Callable[[str], str | None]:
    """The answer-extraction function for `extract`.

    None: the whole text. A regex string: its last match in the text (group 1 if the
    pattern has a group, else the whole match; DOTALL), None when it does not match.
    A callable: used as is (returns the answer or None). A pattern `OPEN(.*?)CLOSE` with
    literal ends (`<answer>(.*?)</answer>`) runs in linear time; another regex is Python's
    `re`, whose time on adversarial text is the pattern's own.
    """
    if extract is None:
        return lambda text: text
    if callable(extract):
        return extract
    if isinstance(extract, str):
        try:
            pattern = re.compile(extract, re.DOTALL)
        except re.error as e:
            raise ValueError(f"extract is not a valid regex: {extract!r} ({e})") from e
        tags = _literal_tags(extract)
        if tags is not None:
            return _between_tags(*tags)

        def from_regex(text: str) -> str | None:
            matches = list(pattern.finditer(text))
            if not matches:
                return None
            last = matches[-1]
            return last.group(1) if pattern.groups else last.group(0)

        return from_regex
    raise ValueError(f"extract must be None, a regex string or a callable, got {type(extract).__name__}")
