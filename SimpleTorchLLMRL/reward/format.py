"""Format rewards: does the final MODEL message follow a regex or a tag schema?

Legend: B batch.

    FormatReward(r"<think>.*?</think>\\s*<answer>.*?</answer>")   # regex, full match (DOTALL)
    FormatReward.from_tags(["think", "answer"])                    # the same as a tag schema
    FormatReward.from_tags(["think", "answer"], partial=True)      # 1/3 per well-formed tag

A tag schema asks for each `<tag>...</tag>` once, in order, with only whitespace around (`strict=True`) or
anything (`strict=False`). `partial=True` pays 1/(n+1) of the way to `correct` per tag that appears once
as an open/close pair; only a full match pays `correct`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from SimpleTorchLLMRL.chat.message import Message, Rollout
from SimpleTorchLLMRL.reward.base import Reward, check_finite

_TAG_NAME = re.compile(r"^[A-Za-z_][\w\-.:]*$")
MODES = ("fullmatch", "search", "match")


def tag_schema_pattern(tags: Sequence[str], strict: bool = True) -> str:
    r"""Regex for `<t1>...</t1> <t2>...</t2> ...`: each tag once, in order, no tag nested in another."""
    parts = []
    for t in tags:
        opening, closing = re.escape(f"<{t}>"), re.escape(f"</{t}>")
        # the body may not contain this tag's own open/close (so "exactly once" holds)
        parts.append(rf"{opening}(?:(?!{opening}|{closing}).)*?{closing}")
    body = r"\s*".join(parts)
    return rf"\s*{body}\s*" if strict else body


class FormatReward(Reward):
    """`correct` when the final MODEL message matches `pattern`, else `incorrect`.

    mode: "fullmatch" (the whole message), "search" (anywhere) or "match" (a
    prefix). Patterns are compiled with DOTALL unless `flags` is given.
    """

    name = "format"

    def __init__(self, pattern: str, mode: str = "fullmatch", correct: float = 1.0, incorrect: float = 0.0,
                 flags: int = re.DOTALL, name: str | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        try:
            self.pattern = re.compile(pattern, flags)
        except re.error as e:
            raise ValueError(f"pattern is not a valid regex: {pattern!r} ({e})") from e
        self.mode = mode
        self.correct = check_finite("correct", correct)
        self.incorrect = check_finite("incorrect", incorrect)
        self.tags: tuple[str, ...] | None = None
        self.partial = False
        if name is not None:
            self.name = name

    @property
    def failure_value(self) -> float:
        return self.incorrect

    @classmethod
    def from_tags(cls, tags: Sequence[str], strict: bool = True, partial: bool = False, correct: float = 1.0,
                  incorrect: float = 0.0, name: str | None = None) -> FormatReward:
        """A tag-schema format reward (see the module docstring)."""
        if isinstance(tags, str) or not tags:
            raise ValueError(f"tags must be a non-empty list of tag names, got {tags!r}")
        for t in tags:
            if not isinstance(t, str) or not _TAG_NAME.match(t):
                raise ValueError(f"tag names must look like XML names (e.g. 'think'), got {t!r}")
        if len(set(tags)) != len(tags):
            raise ValueError(f"tags must be distinct, got {list(tags)}")
        mode = "fullmatch" if strict else "search"
        reward = cls(tag_schema_pattern(tags, strict), mode=mode, correct=correct, incorrect=incorrect, name=name)
        reward.tags = tuple(tags)
        reward.partial = bool(partial)
        return reward

    def matches(self, text: str) -> bool:
        return getattr(self.pattern, self.mode)(text) is not None

    def _partial_score(self, text: str) -> float:
        ok = 0
        for t in self.tags or ():
            n_open, n_close = text.count(f"<{t}>"), text.count(f"</{t}>")
            first_open, first_close = text.find(f"<{t}>"), text.find(f"</{t}>")
            ok += n_open == 1 and n_close == 1 and first_open < first_close
        return self.incorrect + (self.correct - self.incorrect) * ok / (len(self.tags) + 1)

    def score(self, message: Message, ground_truth: Any, rollout: Rollout) -> float:
        if self.matches(message.content):
            return self.correct
        return self._partial_score(message.content) if self.partial else self.incorrect
