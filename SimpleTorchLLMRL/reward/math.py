r"""Math answers: extract `\boxed{...}`, normalize, and decide equivalence.

`math_equal(pred, gold)` is True when the two answers are equivalent. With the
optional `math-verify` package (`uv sync --extra math`) it asks math-verify
first (symbolic equivalence through SymPy); when that says no, or when the
package is missing, a careful normalizer decides:

    1/2 == 0.5 == \frac{1}{2} == \dfrac12 == \tfrac{1}{2}     3.0 == 3 == +3
    "1,000" == 1000 == 1{,}000       5\text{ cm} == 5 cm == 5     x = 3 == 3
    90^\circ == 90       50\% == 50       $-2$ == −2 (unicode minus)
    (1, \frac{1}{2}) == (1,0.5)   (elementwise; brackets must match: (1,2] != (1,2))

It does no algebra: 2\sqrt{2} vs \sqrt{8} needs math-verify.
"""

from __future__ import annotations

import functools
import re
import threading
import unicodedata
from fractions import Fraction

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


def _match_brace(text: str, open_at: int) -> int | None:
    """Index of the `}` closing the `{` at `open_at`; None if unbalanced."""
    return _brace_pairs(text).get(open_at)


def extract_boxed(text: str | None) -> str | None:
    r"""Content of the last complete `\boxed{...}` (or `\fbox{...}`, or `\boxed 5`) in `text`.

    Nested braces are kept (`\boxed{\frac{1}{2}}` -> `\frac{1}{2}`). An unclosed
    final box (a truncated generation) is skipped in favour of an earlier complete
    one. None when there is no box. Linear time in len(text).
    """
    if not text:
        return None
    pairs = None
    for m in reversed(list(_BOX_CMD.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            pairs = _brace_pairs(text) if pairs is None else pairs
            close = pairs.get(i)
            if close is not None:
                return text[i + 1: close].strip()
            continue
        arg = re.match(r"[^\s${}\\]+", text[i:i + 200])  # "\boxed 5" / "\boxed5": one plain token
        if arg and arg.group(0).rstrip(".,;"):
            return arg.group(0).rstrip(".,;")
    return None


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
_TEXT_CMD = r"\\(?:text|textrm|textbf|textit|mbox|mathrm|operatorname)"
_TRAILING_UNIT = re.compile(_TEXT_CMD + r"\{[^{}]*\}(?:\^\{?\d\}?)?\s*$")
_TEXT_WRAP = re.compile(_TEXT_CMD + r"\{([^{}]*)\}")
_LHS = re.compile(r"^\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?\w+\}?)?\s*=\s*(?!=)")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"  # unambiguous: no quadratic backtracking
_WORD_UNITS = re.compile(rf"^({_NUM})\s+[A-Za-z]{{2,}}(?:\s+[A-Za-z]+)*\.?$")


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

    Unicode NFKC, math delimiters, spacing and sizing commands, `\dfrac`/`\tfrac`,
    degrees, percent and dollar signs, trailing `\text{}` units, a leading
    `x =`, thousands separators, whitespace, a trailing period and a redundant
    outer pair of braces are removed; text-only answers are lower-cased.
    """
    s = unicodedata.normalize("NFKC", str(answer)).translate(_UNICODE)
    s = _strip_delimiters(s.replace("\n", " "))
    boxed = extract_boxed(s) if "\\boxed" in s or "\\fbox" in s else None
    if boxed is not None:
        s = boxed
    s = _DROP_RE.sub("", s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    for _ in range(3):  # "5\text{ cm}^2" -> "5"; a bare "\text{yes}" is kept (unwrapped below)
        m = _TRAILING_UNIT.search(s)
        if not m or not s[: m.start()].strip():
            break
        s = s[: m.start()]
    s = _TEXT_WRAP.sub(r"\1", s).strip()
    m = _WORD_UNITS.match(s)  # "5 apples" -> "5"
    if m:
        s = m.group(1)
    if s.count("=") == 1 and _LHS.match(s):
        s = _LHS.sub("", s, count=1)
    s = s.rstrip(".").strip()
    s = re.sub(r"\s+", "", s).replace("{,}", ",")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = _fix_fracs(s)
    for _ in range(3):  # "{7}" -> "7" (bounded: each check is a linear scan)
        if not (s.startswith("{") and s.endswith("}") and _match_brace(s, 0) == len(s) - 1):
            break
        s = s[1:-1]
    if s.startswith("+"):
        s = s[1:]
    if "\\" not in s:
        s = s.lower()
    return s


# ---------------------------------------------------------------- numbers

_DECIMAL = re.compile(rf"^{_NUM}(?:e[+-]?\d+)?$")
_SCI = re.compile(rf"^({_NUM})\\(?:times|cdot)10\^\{{?([+-]?\d+)\}}?$")
_FRAC = re.compile(r"^([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")
_MAX_EXP = 400


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


_PAIRS = {"(": ")", "[": "]", "\\{": "\\}", "\\langle": "\\rangle"}


def _split_top_level(s: str) -> tuple[str, list[str], str] | None:
    r"""`(a,b]` -> ("(", ["a", "b"], "]"): the wrapper and the depth-0 comma-separated items."""
    opener = next((o for o in _PAIRS if s.startswith(o)), "")
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


def _numbers_close(a: Fraction, b: Fraction, rel_tol: float) -> bool:
    if a == b:
        return True
    return rel_tol > 0 and abs(a - b) <= Fraction(rel_tol) * max(abs(a), abs(b))


def _normalized_equal(a: str, b: str, rel_tol: float, depth: int = 0) -> bool:
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    if x is not None and y is not None:
        return _numbers_close(x, y, rel_tol)
    if depth > 3 or ("," not in a and "," not in b):
        return False
    sa, sb = _split_top_level(a), _split_top_level(b)
    if sa is None or sb is None or sa[0] != sb[0] or sa[2] != sb[2] or len(sa[1]) != len(sb[1]) or len(sa[1]) < 2:
        return False
    return all(_normalized_equal(p, q, rel_tol, depth + 1) for p, q in zip(sa[1], sb[1], strict=True))


def fallback_equal(pred, gold, rel_tol: float = 1e-9) -> bool:
    """Equivalence by `normalize_math` + exact rational comparison (no math-verify)."""
    return _normalized_equal(normalize_math(pred), normalize_math(gold), rel_tol)


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


def math_verify_equal(pred: str, gold: str) -> bool:
    r"""math-verify's verdict on `\boxed{pred}` against `\boxed{gold}`; False on any parse failure."""
    mv = _import_math_verify()
    # math-verify's timeouts use SIGALRM, which only works on the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        g = mv.parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
        p = mv.parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout)
        return bool(g) and bool(p) and bool(mv.verify(g, p, timeout_seconds=timeout))
    except Exception:  # assorted parser errors
        return False
    except BaseException as e:  # math-verify's TimeoutException derives from BaseException
        if type(e).__name__ == "TimeoutException":
            return False
        raise


def math_equal(pred, gold, *, use_math_verify: bool | None = None, rel_tol: float = 1e-9) -> bool:
    """True when `pred` and `gold` are the same math answer.

    use_math_verify: None = use it when installed; True = require it (ImportError
    naming `uv sync --extra math` otherwise); False = normalizer only. math-verify
    and the normalizer are OR-ed: either one saying "equal" is enough.
    """
    if pred is None or gold is None:
        return False
    pred, gold = str(pred), str(gold)
    if use_math_verify is True or (use_math_verify is None and math_verify_available()):
        if math_verify_equal(pred, gold):
            return True
    return fallback_equal(pred, gold, rel_tol)
