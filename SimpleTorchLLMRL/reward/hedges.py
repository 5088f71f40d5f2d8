r"""Hedges: words that turn one answer into several, or into a non-answer.

`17 or 18`, `17 \text{ (or 18)}`, `5 is not the answer`, `17 eighteen`: a normalizer that
strips trailing words as units would read each as the bare number. An answer may use
such a word only where the gold answer uses it too (`(11,7) or (7,11)`).
"""

from __future__ import annotations

import re

HEDGE_WORDS = frozenset(
    "or nor not no never maybe perhaps possibly probably either neither unless except but if "
    "wrong incorrect false isn't aren't cannot can't".split()
)
NUMBER_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety "
    "hundred thousand million billion trillion half third quarter".split()
)
NOT_UNITS = HEDGE_WORDS | NUMBER_WORDS | frozenset("is are was were be the answer equals".split())

_WORD = re.compile(r"(?<![A-Za-z\\])[A-Za-z]+(?:'[a-z]+)?")  # a word, not a LaTeX command's name


def words(text: str) -> set[str]:
    """Lower-cased words of `text`, LaTeX command names (`\\frac`) excluded."""
    return {w.lower() for w in _WORD.findall(text)}


def hedge_words(pred: str, gold: str) -> set[str]:
    """Hedge and number words the answer uses and the gold does not (empty: no hedge)."""
    return (words(pred) & (HEDGE_WORDS | NUMBER_WORDS)) - words(gold)


def is_unit(text: str) -> bool:
    """Can `text` (a few letters-only words) be a unit, not a hedge (`or 18`) or a number word?"""
    return not (words(text) & NOT_UNITS)
