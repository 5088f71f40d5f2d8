r"""Math answers: extract `\boxed{...}`, normalize, and decide equivalence.

`math_equal(pred, gold)`: the anti-hacking rules first (`answer_rule`: hedges like `17 or 18` score nothing;
against a numeric gold the answer must be a number, compared exactly), then `math-verify` when installed
(final when it gives a verdict; in worker processes with a deadline), then a careful normalizer:

    1/2 == 0.5 == \frac{1}{2} == \dfrac12 == \cfrac{1}{2} == \left(\frac12\right)   3.0 == 3 == +3
    "1,000" == 1000 == 1{,}000 ("32, 349" is a list)   5\text{ cm} == 5\textnormal{ cm} == 5 cm == 5
    x = 3 == 3     90^\circ == 90     50\% == $50$ % == 50     $-2$ == -2 (unicode minus)
    (1, \frac{1}{2}) == (1,0.5)   (elementwise; brackets must match: (1,2] != (1,2))

It does no algebra (2\sqrt{2} vs \sqrt{8} needs math-verify). See docs/rewards.md.
"""

from __future__ import annotations

import functools
import re
import unicodedata

from SimpleTorchLLMRL.reward.base import missing_reason
from SimpleTorchLLMRL.reward.math_verify_pool import ask_math_verify
from SimpleTorchLLMRL.reward.numbers import NUM as _NUM
from SimpleTorchLLMRL.reward.numbers import is_literal, normalized_equal

_BOX_CMD = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _brace_pairs(text: str) -> dict[int, int]:
    """{index of "{": index of its closing "}"} in one pass (escaped `\\{` `\\}` skipped); unclosed ones absent."""
    pairs, stack, i = {}, [], 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def extract_boxed(text: str | None) -> str | None:
    r"""Content of the last complete `\boxed{...}` (or `\fbox{...}`, or `\boxed 5`) in `text`.

    Nested braces are kept (`\boxed{\frac{1}{2}}` -> `\frac{1}{2}`). An unclosed
    final box (a truncated generation) is skipped in favour of an earlier complete
    one. None when there is no box. Linear time in len(text).
    """
    spans = _box_spans(text)
    return spans[-1][2] if spans else None


def _box_spans(text: str | None) -> list[tuple[int, int, str]]:
    """(start, end, content) of every complete outermost box, in order (linear time)."""
    if not text:
        return []
    pairs, spans, end = None, [], -1
    for m in _BOX_CMD.finditer(text):
        if m.start() < end:
            continue  # a box inside another box is part of the outer one
        i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            pairs = _brace_pairs(text) if pairs is None else pairs
            close = pairs.get(i)
            if close is not None:  # an unclosed (truncated) box is skipped
                spans.append((m.start(), close + 1, text[i + 1: close].strip()))
                end = close
            continue
        arg = re.match(r"[^\s${}\\]+", text[i:i + 200])
        if arg and arg.group(0).rstrip(".,;"):
            spans.append((m.start(), i + len(arg.group(0)), arg.group(0).rstrip(".,;")))
    return spans


_CONNECTIVE = re.compile(r"(?:\s|[,;.&]|\$|\\[()\[\],]|\\q?quad(?![A-Za-z])|\\text\{\s*and\s*\}|and(?![A-Za-z]))*")


def boxed_answer(text: str | None, *, all_boxes: bool = True) -> str | None:
    r"""The answer a text gives in boxes: one box's content, or its distinct boxes joined as a list.

    `\boxed{1} and \boxed{-2}` -> `1, -2` (math-verify's reading: a set); a box repeated
    with the same answer counts once. all_boxes=False (how a gold is read): only the last
    run of boxes joined by nothing but punctuation, spacing or "and" (math-verify's
    reading of `\boxed{1} no no \boxed{2}` is `2`). None when there is no non-empty box.
    """
    spans = _box_spans(text)
    if not all_boxes:
        first = len(spans) - 1
        while first > 0 and _CONNECTIVE.fullmatch(text, spans[first - 1][1], spans[first][0]):
            first -= 1
        spans = spans[first:]
    distinct, seen = [], set()
    for _, _, box in spans:
        key = normalize_math(box)
        if key and key not in seen:
            seen.add(key)
            distinct.append(box)
    return ", ".join(distinct) if distinct else None


# ---------------------------------------------------------------- hedges

# Words that turn one answer into several, or into a non-answer: `17 or 18`, `17 \text{ (or 18)}`,
# `5 is not the answer`, `17 eighteen`. A normalizer that strips trailing words as units would read
# each as the bare number; an answer may use such a word only where the gold answer uses it too
# (`(11,7) or (7,11)`).

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


# ---------------------------------------------------------------- normalization

_UNICODE = str.maketrans({
    "\u2212": "-", "\u2013": "-", "\u2014": "-", "\u2044": "/", "\u00d7": "\\times ", "\u00f7": "\\div ",
    "\u03c0": "\\pi ", "\u221e": "\\infty ", "\u221a": "\\sqrt", "\u00b7": "\\cdot ", "\u00b0": "^\\circ",
    "\u2264": "\\le ", "\u2265": "\\ge ", "\u2260": "\\ne ",
})
_DROP = [
    r"\\left(?![A-Za-z])", r"\\right(?![A-Za-z])", r"\\displaystyle", r"\\[!,;:>]", r"\\q?quad(?![A-Za-z])",
    r"\\ ", r"~", r"\^\{?\\circ\}?", r"\\%", r"%", r"\\\$", r"\\mathrm\{\s*\}",
]
_DROP_RE = re.compile("|".join(_DROP))
_TEXT_CMD = r"\\(?:text|textrm|textnormal|textbf|textit|textsf|mbox|mathrm|operatorname)"
_UNIT_WORDS = r"[A-Za-z]+\.?(?:[ /][A-Za-z]+\.?){0,2}"  # "cm", "sq. ft", "km/h": letters only, at most 3 words
_TRAILING_UNIT = re.compile(_TEXT_CMD + r"\{\s*(" + _UNIT_WORDS + r")\s*\}(?:\^\{?\d\}?)?\s*$")
_TEXT_WRAP = re.compile(_TEXT_CMD + r"\{([^{}]*)\}")
_LHS = re.compile(r"^\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?\w+\}?)?\s*=\s*(?!=)")
_IN_LHS = re.compile(r"^\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?\w+\}?)?\s*\\in(?![A-Za-z])\s*")  # "x \in [-2, 7]"
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_WORD_UNITS = re.compile(rf"^({_NUM})\s+([A-Za-z]{{2,}}(?:\s+[A-Za-z]+){{0,2}})\.?$")


def _single_group(s: str) -> bool:
    """Is `s` = "(...)" one parenthesized item: the first "(" closes at the end, no top-level comma inside?"""
    depth = 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0 and i != len(s) - 1:
                return False
        elif c == "," and depth == 1:
            return False
    return depth == 0


def _strip_delimiters(s: str) -> str:
    s = s.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left): len(s) - len(right)].strip()
    return s


def _fix_fracs(s: str) -> str:
    r"""`\frac12` -> `\frac{1}{2}`, `\frac1{2}` -> `\frac{1}{2}`, `\sqrt2` -> `\sqrt{2}`."""
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac(\w)(\w)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\w)\{", r"\\frac{\1}{", s)
    return re.sub(r"\\frac(\{[^{}]*\})(\w)", r"\\frac\1{\2}", s)


def normalize_math(answer) -> str:
    r"""A canonical string for a math answer (no algebra; see the module docstring).

    Unicode NFKC, math delimiters, spacing and sizing commands, `\dfrac`/`\tfrac`, degrees, percent and dollar
    signs, trailing `\text{}` units, a leading `x =`, thousands separators, whitespace, a trailing period and
    a redundant outer pair of braces are removed; text-only answers are lower-cased.
    """
    s = unicodedata.normalize("NFKC", str(answer)).translate(_UNICODE)
    s = _strip_delimiters(s.replace("\n", " "))
    boxed = extract_boxed(s) if "\\boxed" in s or "\\fbox" in s else None
    if boxed is not None:
        s = boxed
    s = _strip_delimiters(re.sub(r"(?<!\\)\$", " ", s))  # "$28$ %": a dollar sign is never part of the value
    s = _DROP_RE.sub("", s)
    s = re.sub(r"\\[dtc]frac(?![A-Za-z])", r"\\frac", s)
    for _ in range(3):  # "5\text{ cm}^2" -> "5"; a bare "\text{yes}" is kept (unwrapped below)
        m = _TRAILING_UNIT.search(s)
        if not m or not s[: m.start()].strip() or not is_unit(m.group(1)):
            break
        s = s[: m.start()]
    s = _TEXT_WRAP.sub(r"\1", s).strip()
    m = _WORD_UNITS.match(s)  # "5 apples" -> "5"; "5 or six" stays
    if m and is_unit(m.group(2)):
        s = m.group(1)
    if s.count("=") == 1 and _LHS.match(s):
        s = _LHS.sub("", s, count=1)
    elif "=" not in s:
        s = _IN_LHS.sub("", s, count=1)
    s = s.rstrip(".").strip().replace("{,}", ",")
    if _THOUSANDS.match(s):  # "1,000" (no space after the comma: "32, 349" is a list)
        s = s.replace(",", "")
    s = re.sub(r"\s+", "", s)
    s = _fix_fracs(s)
    for _ in range(3):  # "{7}" -> "7", "(\frac{1}{3})" -> "\frac{1}{3}" (bounded: each check is a linear scan)
        if s.startswith("{") and s.endswith("}") and _brace_pairs(s).get(0) == len(s) - 1:
            s = s[1:-1]
        elif s.startswith("(") and s.endswith(")") and _single_group(s):
            s = s[1:-1]
        else:
            break
    if s.startswith("+"):
        s = s[1:]
    if "\\" not in s:
        s = s.lower()
    return s


def fallback_equal(pred, gold, rel_tol: float = 1e-9) -> bool:
    """Equivalence by `normalize_math` + exact rational comparison (no math-verify)."""
    return normalized_equal(normalize_math(pred), normalize_math(gold), rel_tol)


# ---------------------------------------------------------------- rules that hold in both modes

_COSTLY = re.compile(
    r"\^\s*\{[^{}]*\^"          # an exponent tower: 9^{9^{9}}
    r"|\^\s*\d+\s*\^"            # 9^9^9
    r"|\^\s*\{?\s*[+-]?\d{5,}"    # an exponent of 10000 or more
    r"|\d{4,}\s*\}?\s*!"         # 1000!
    r"|!\s*\)*\s*!"               # (5!)!, 5!!
)


def too_costly(answer: str) -> bool:
    r"""Could evaluating `answer` take SymPy minutes (exponent towers, huge exponents, factorials)?"""
    return _COSTLY.search(answer) is not None


def answer_rule(pred: str, gold: str, rel_tol: float = 1e-9) -> bool | None:
    r"""The verdict of the anti-hacking rules, or None when they leave it to the comparison.

    False: the answer hedges (`17 or 18`, `5 is not the answer`), or the gold is a number (or a list of
    numbers) and the answer is not written as one: `645 \times 49`, `\sqrt{4}`, `\frac{4}{2}` restate a
    question rather than answer it. Numbers against numbers are decided here, exactly (integers never within a
    tolerance), the same way with and without math-verify.
    """
    if hedge_words(pred, gold):
        return False
    p, g = normalize_math(pred), normalize_math(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    if not is_literal(g):
        return None
    return normalized_equal(_final_value(p), g, rel_tol, literal_only=True)


_APPROX = re.compile(r"\\approx(?![A-Za-z])")
_VARIABLE = re.compile(r"^(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?\w+\}?)?$")


def _final_value(answer: str) -> str:
    r"""The value a normalized chain of equalities ends with: `x=5+5+1=11` -> `11`, `645\times49=31605` -> `31605`.

    An approximation after the value is dropped (`x=1/3\approx0.33` -> `1/3`; `x\approx11` -> `11`).
    Only used against a numeric gold, where the answer must end in a number written as a result.
    """
    parts = _APPROX.split(answer, maxsplit=1)
    if len(parts) == 2 and not (_VARIABLE.match(parts[0]) and "=" not in parts[1]):
        answer = parts[0]
    else:
        answer = "=".join(parts)
    return answer.rsplit("=", 1)[-1] if "=" in answer else answer


# ---------------------------------------------------------------- math-verify


@functools.cache
def math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def _import_math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "use_math_verify=True needs the optional math-verify package: run `uv sync --extra math` "
            "(or pip install 'math-verify>=0.8')"
        ) from e
    return math_verify


def math_verify_equal(pred: str, gold: str, timeout: float = 5.0) -> bool | None:
    r"""math-verify's verdict on `\boxed{pred}` against `\boxed{gold}`, within `timeout` seconds on any thread.

    None: no verdict (it could not read one of them, the answer is too costly to
    evaluate, or it ran past `timeout` and its worker process was killed).
    """
    _import_math_verify()
    if too_costly(pred) or too_costly(gold):
        return None
    return ask_math_verify(str(gold), str(pred), timeout)


def math_equal(pred, gold, *, use_math_verify: bool | None = None, rel_tol: float = 1e-9,
               timeout: float = 5.0) -> bool:
    """True when `pred` and `gold` are the same math answer.

    In order: the anti-hacking rules (`answer_rule`: hedges, unevaluated expressions
    against a numeric gold, exact numbers); then math-verify, whose verdict is final when
    it gives one (use_math_verify: None = when installed, True = required, False = never);
    then the normalizer (`fallback_equal`). `timeout`: seconds math-verify may spend. A missing
    gold (None, a float NaN, pandas NA, blank: `reward.base.missing_reason`) matches nothing:
    the text "nan" is no answer to an empty cell.
    """
    if pred is None or missing_reason(gold) is not None:
        return False
    pred, gold = str(pred), str(gold)
    verdict = answer_rule(pred, gold, rel_tol)
    if verdict is not None:
        return verdict
    if use_math_verify is True or (use_math_verify is None and math_verify_available()):
        verdict = math_verify_equal(pred, gold, timeout)
        if verdict is not None:
            return verdict
    return fallback_equal(pred, gold, rel_tol)
