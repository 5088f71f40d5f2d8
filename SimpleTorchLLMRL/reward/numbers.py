r"""Numbers and lists of numbers in normalized math answers (`normalize_math`'s output), compared exactly.

`to_number`: the exact Fraction of `3`, `-0.5`, `1e3`, `2\times10^{3}`, `\frac{a}{b}`, `a/b`. `literal_number`:
a number written as a *result* (an integer, a decimal, scientific notation, a fraction in lowest terms; not
`645\times49` or `\frac{4}{2}`). `normalized_equal`: integers exactly, `rel_tol` only when neither side is
an integer; a bare list and a set `\{1, 2\}` as multisets, tuples and intervals in order, brackets included.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"  # unambiguous: no quadratic backtracking
_DECIMAL = re.compile(rf"^{NUM}(?:e[+-]?\d+)?$")
_SCI = re.compile(rf"^({NUM})\\(?:times|cdot)10\^\{{?([+-]?\d+)\}}?$")
_FRAC = re.compile(r"^([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")
_INT = re.compile(r"^[+-]?\d+$")
_MAX_EXP = 400
_MAX_ITEMS = 1000


def _exp_ok(text: str) -> bool:
    m = re.search(r"e([+-]?\d+)$", text)
    return m is None or abs(int(m.group(1))) <= _MAX_EXP


def to_number(s: str) -> Fraction | None:
    r"""Exact value of a normalized numeric answer: `3`, `-0.5`, `1e3`, `2\times10^{3}`, `\frac{a}{b}`, `a/b`."""
    try:
        if _DECIMAL.match(s):
            return Fraction(s) if _exp_ok(s) else None
        m = _SCI.match(s)
        if m:
            exp = int(m.group(2))
            return Fraction(m.group(1)) * Fraction(10) ** exp if abs(exp) <= _MAX_EXP else None
        m = _FRAC.match(s)
        if m:
            num, den = to_number(m.group(2)), to_number(m.group(3))
            if num is None or den is None or den == 0:
                return None
            return -num / den if m.group(1) == "-" else num / den
        if s.count("/") == 1:
            a, b = s.split("/")
            num, den = to_number(a), to_number(b)
            if num is not None and den is not None and den != 0 and not b.startswith(("+", "-")):
                return num / den
    except (ValueError, ZeroDivisionError, OverflowError):  # e.g. over Python's int-digit limit
        return None
    return None


def _fraction_parts(s: str) -> tuple[str, str] | None:
    """(numerator, denominator) texts of `\\frac{a}{b}`, `-\\frac{a}{b}` or `a/b`; None for other forms."""
    m = _FRAC.match(s)
    if m:
        return m.group(2), m.group(3)
    if s.count("/") == 1:
        return tuple(s.split("/"))
    return None


def literal_number(s: str) -> Fraction | None:
    """The value of `s` if it is written as a result (see the module docstring), else None."""
    value = to_number(s)
    if value is None:
        return None
    parts = _fraction_parts(s)
    if parts is None:
        return value
    num, den = parts
    if not (_INT.match(num) and _INT.match(den)) or den.startswith(("+", "-")):
        return None  # \frac{0.5}{2}, \frac{6}{-3}: not how a result is written
    n, d = abs(int(num)), int(den)
    return value if d > 1 and math.gcd(n, d) == 1 else None  # \frac{4}{2}, \frac{63210}{2}: unevaluated


PAIRS = {"(": ")", "[": "]", "\\{": "\\}", "\\langle": "\\rangle"}
_UNORDERED = ("", "\\{")  # a bare list and a set


def split_top_level(s: str) -> tuple[str, list[str], str] | None:
    r"""`(a,b]` -> ("(", ["a", "b"], "]"): the wrapper and the depth-0 comma-separated items."""
    opener = next((o for o in PAIRS if s.startswith(o)), "")
    closer = next((c for c in (")", "]", "\\}", "\\rangle") if s.endswith(c)), "") if opener else ""
    if opener and not closer:
        return None
    inner = s[len(opener): len(s) - len(closer)]
    items, depth, start, i = [], 0, 0, 0
    while i < len(inner):
        c = inner[i]
        if c == "\\" and inner[i + 1: i + 2] in ("{", "}"):
            depth += 1 if inner[i + 1] == "{" else -1
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(inner[start:i])
            start = i + 1
        i += 1
    items.append(inner[start:])
    return opener, items, closer


def numbers_close(a: Fraction, b: Fraction, rel_tol: float) -> bool:
    """Equal, or (neither an integer) within `rel_tol` relative difference."""
    if a == b:
        return True
    if a.denominator == 1 or b.denominator == 1 or rel_tol <= 0:
        return False
    return abs(a - b) <= Fraction(rel_tol) * max(abs(a), abs(b))


def _sort_key(item: str) -> tuple:
    value = to_number(item)
    return (0, value, "") if value is not None else (1, 0, item)


def normalized_equal(a: str, b: str, rel_tol: float, *, literal_only: bool = False, depth: int = 0) -> bool:
    """Equivalence of two normalized answers: equal text, equal numbers, or equal lists of these.

    literal_only: `a` (the answer) must be a literal (`literal_number`) or a list of literals.
    """
    if not a or not b:
        return False
    x, y = (literal_number(a) if literal_only else to_number(a)), to_number(b)
    if x is not None and y is not None:
        return numbers_close(x, y, rel_tol)
    if a == b and not literal_only:
        return True
    if depth > 3 or ("," not in a and "," not in b):
        return False
    sa, sb = split_top_level(a), split_top_level(b)
    if sa is None or sb is None or len(sa[1]) != len(sb[1]) or not 2 <= len(sa[1]) <= _MAX_ITEMS:
        return False
    items_a, items_b = sa[1], sb[1]
    wrappers = sa[0] + sa[2] + sb[0] + sb[2]
    if (sa[0], sa[2]) != (sb[0], sb[2]) and not ("" in (sa[0], sb[0]) and wrappers in ("()", "[]", "\\{\\}")):
        return False  # a bare list matches a tuple or a list in order, a set as a set; never an interval
    if sa[0] in _UNORDERED and sb[0] in _UNORDERED:
        items_a, items_b = sorted(items_a, key=_sort_key), sorted(items_b, key=_sort_key)
    return all(normalized_equal(p, q, rel_tol, literal_only=literal_only, depth=depth + 1)
               for p, q in zip(items_a, items_b, strict=True))


def is_literal(s: str, depth: int = 0) -> bool:
    """Is the normalized answer `s` a number or a (nested) list of numbers, written as results or not?"""
    if to_number(s) is not None:
        return True
    if depth > 3 or "," not in s:
        return False
    parts = split_top_level(s)
    return parts is not None and len(parts[1]) <= _MAX_ITEMS and all(is_literal(p, depth + 1) for p in parts[1])
