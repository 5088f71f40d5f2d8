"""Text answers: exact match and token F1 with SQuAD normalization.

Legend: B batch.

    em = ExactMatch(extract=r"<answer>(.*?)</answer>")       # reads the last <answer> of the reply
    f1 = TokenF1(extract=r"<answer>(.*?)</answer>", keep_numbers=True)
    em(rollouts, ["Paris", ["NYC", "New York City"]])        # a list of golds: best match counts

SQuAD normalization (lower-case, no ASCII punctuation, no a/an/the, one space); `keep_numbers=True` keeps a
number's sign and decimal point ("-3.5" does not become "35"). Token F1 counts repeated tokens with multiplicity.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable
from typing import Any

from SimpleTorchLLMRL.chat.message import Message, Rollout
from SimpleTorchLLMRL.reward.base import Reward, answers_of, check_finite, make_extractor

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SIGN = re.compile(r"(?<![\w.])[+-](?=\d)")          # sign of a number: not after a word or a point
_DECIMAL_POINT = re.compile(r"(?<=\d)\.(?=\d)")     # 3.14


def _remove_punctuation(text: str, keep_numbers: bool) -> str:
    if not keep_numbers:
        return "".join(c for c in text if c not in _PUNCT)
    keep = {m.start() for m in _SIGN.finditer(text)} | {m.start() for m in _DECIMAL_POINT.finditer(text)}
    return "".join(c for i, c in enumerate(text) if c not in _PUNCT or i in keep)


def normalize_squad(text: str, keep_numbers: bool = False) -> str:
    """SQuAD answer normalization; `keep_numbers` keeps signs and decimal points of numbers."""
    text = _remove_punctuation(str(text).lower(), keep_numbers)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, ground_truth: str, keep_numbers: bool = False) -> float:
    return float(normalize_squad(prediction, keep_numbers) == normalize_squad(ground_truth, keep_numbers))


def f1_score(prediction: str, ground_truth: str, keep_numbers: bool = False) -> float:
    """Token F1 of the normalized strings; two empty answers score 1, one empty scores 0."""
    pred = normalize_squad(prediction, keep_numbers).split()
    gold = normalize_squad(ground_truth, keep_numbers).split()
    if not pred or not gold:
        return float(pred == gold)
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


class _TextMatch(Reward):
    """Shared config: extraction, number-keeping normalization, and the no-answer value."""

    metric: Callable[[str, str, bool], float]
    needs_ground_truth = True

    def __init__(self, extract: str | Callable[[str], str | None] | None = None, keep_numbers: bool = False,
                 scale: float = 1.0, no_answer: float = 0.0, name: str | None = None):
        self._extract = make_extractor(extract)
        if not isinstance(keep_numbers, bool):
            raise ValueError(f"keep_numbers must be True or False, got {keep_numbers!r}")
        self.keep_numbers = keep_numbers
        self.scale = check_finite("scale", scale)
        self.no_answer = check_finite("no_answer", no_answer)
        if name is not None:
            self.name = name

    @property
    def failure_value(self) -> float:
        return self.no_answer

    def extract(self, text: str) -> str | None:
        return self._extract(text)

    def score(self, message: Message, ground_truth: Any, rollout: Rollout) -> float:
        golds = [str(g) for g in answers_of(ground_truth)]
        answer = self.extract(message.content)
        if answer is None:
            return self.no_answer
        return self.scale * max(type(self).metric(answer, g, self.keep_numbers) for g in golds)


class ExactMatch(_TextMatch):
    """`scale` when the normalized answer equals a normalized gold, else 0; `no_answer` when `extract` finds none."""

    name = "exact_match"
    metric = staticmethod(exact_match_score)


class TokenF1(_TextMatch):
    """`scale` * best token F1 against the gold(s); `no_answer` when `extract` finds none."""

    name = "f1"
    metric = staticmethod(f1_score)
