"""Values as typed data: what a sandboxed solution returns, sent back as a flat list of tokens.

    tokens = encode([1, (2.5, "x")])      # ['l', 1 ... ] -> one flat JSON array, never nested
    decode(tokens) == [1, (2.5, "x")]     # True

A value travels in prefix order: a tag, then its payload (a count, then the items, for
containers). The list is flat, so JSON never nests and neither side recurses: both walk
it with an explicit stack, bounded by `MAX_DEPTH` and by the channel's size. What
decodes is built from fresh built-in objects only (no class of the solution's, no
method it wrote), so comparing it runs Python's own `==`.

Kept as Python keeps them: None, bool, int, float (inf and nan too, bit-exact), complex,
str, bytes, list, tuple, dict, set, frozenset, Counter, OrderedDict, defaultdict (as a
dict), namedtuple (a namedtuple of the same fields), Fraction, Decimal, numpy scalars
(as the Python scalar they hold) and numpy arrays of numbers or bools. Anything else
raises `CodecError`, and a test that compares it scores 0.

This file is also sent into the sandbox as the source of the encoder and runs in every
run: it imports nothing at the top (a module the solution returned a value of is already
in `sys.modules`; numpy only ever so), and the decoder imports what a tag needs.
"""

import sys

MAX_DEPTH = 100  # nesting of containers, both ways
_CONTAINERS = {"l": list, "t": tuple, "S": set, "Z": frozenset}
_MAPPINGS = {"d": "dict", "o": "OrderedDict", "C": "Counter"}
_NAMEDTUPLES = {}  # (typename, fields) -> a fresh namedtuple class, made once


class CodecError(ValueError):
    """A value that cannot travel, or tokens that do not decode to one."""


def _float(x):
    return "nan" if x != x else x.hex()  # float.hex keeps every bit; nan's sign and payload do not matter


def _scalar(x):
    """The tokens of a value that holds no other value, or None for a container."""
    t = type(x)
    if x is None:
        return ["N"]
    if t is bool:
        return ["T" if x else "F"]
    if t is int:
        return ["i", hex(x)]
    if t is float:
        return ["f", _float(x)]
    if t is complex:
        return ["c", _float(x.real), _float(x.imag)]
    if t is str:
        return ["s", x]
    if t is bytes:
        return ["b", x.hex()]
    fractions, decimal = sys.modules.get("fractions"), sys.modules.get("decimal")
    if fractions is not None and t is fractions.Fraction:
        return ["q", hex(x.numerator), hex(x.denominator)]
    if decimal is not None and t is decimal.Decimal:
        return ["D", str(x)]
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, numpy.generic) and not isinstance(x, (numpy.void, numpy.object_)):
        item = x.item()
        if type(item) in (bool, int, float, complex, str, bytes):
            return _scalar(item)
    return None


def _children(x):
    """(tag, header tokens, items) of a container, or raise CodecError."""
    t = type(x)
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "S", frozenset: "Z"}[t]
        items = list(x)
        return tag, [len(items)], items
    collections = sys.modules.get("collections")
    kinds = {dict: "d"} if collections is None else {
        dict: "d", collections.defaultdict: "d", collections.OrderedDict: "o", collections.Counter: "C"}
    if t in kinds:
        tag = kinds[t]
        pairs = list(dict.items(x))
        return tag, [len(pairs)], [v for pair in pairs for v in pair]
    if isinstance(x, tuple) and type(getattr(t, "_fields", None)) is tuple:
        fields = list(t._fields)
        if all(type(f) is str for f in fields) and len(fields) == tuple.__len__(x):
            return "n", [t.__name__, len(fields), *fields], list(tuple.__iter__(x))
    numpy = sys.modules.get("numpy")
    if numpy is not None and t is numpy.ndarray and x.dtype.kind in "biufc":
        return "A", [x.dtype.str, x.ndim, *x.shape], x.reshape(-1).tolist()
    raise CodecError(f"a {t.__module__}.{t.__qualname__} cannot travel as data")


def encode(value):
    """The flat token list of `value`; raises CodecError for what cannot travel (or nests too deep)."""
    out = []
    stack = [iter([value])]  # iterators over the items still to write, one per open container
    while stack:
        x = next(stack[-1], _END)
        if x is _END:
            stack.pop()
            continue
        tokens = _scalar(x)
        if tokens is not None:
            out += tokens
            continue
        tag, header, items = _children(x)
        if len(stack) > MAX_DEPTH:
            raise CodecError(f"the value nests deeper than {MAX_DEPTH}")
        out.append(tag)
        out += header
        if tag == "A":  # array items are numbers: written here, each as its scalar
            for item in items:
                out += _scalar(item)
            continue
        stack.append(iter(items))
    return out


_END = object()


def _hexint(s):
    if type(s) is not str:
        raise CodecError(f"expected a hex string, got {type(s).__name__}")
    return int(s, 16)


def _hexfloat(s):
    if type(s) is not str:
        raise CodecError(f"expected a float string, got {type(s).__name__}")
    return float("nan") if s == "nan" else float.fromhex(s)


def _count(tokens, i):
    n = tokens[i] if i < len(tokens) else None
    if type(n) is not int or n < 0 or n > len(tokens):
        raise CodecError(f"a bad count at token {i}: {n!r}")
    return n


def _namedtuple(name, fields):
    import collections

    key = (name, tuple(fields))
    if key not in _NAMEDTUPLES:
        if len(_NAMEDTUPLES) > 256:
            _NAMEDTUPLES.clear()
        _NAMEDTUPLES[key] = collections.namedtuple(name, fields)
    return _NAMEDTUPLES[key]


def _finish(tag, header, items):
    if tag in _CONTAINERS:
        return _CONTAINERS[tag](items)
    if tag in _MAPPINGS:  # dict(pairs) first: Counter(pairs) would count the pairs themselves
        import collections

        kind = dict if tag == "d" else getattr(collections, _MAPPINGS[tag])
        return kind(dict(zip(items[0::2], items[1::2], strict=True)))
    if tag == "n":
        return _namedtuple(header[0], header[1])(*items)
    raise CodecError(f"unknown container tag {tag!r}")


def _read_scalar(tokens, i):
    """(value, next index) for a scalar tag at i, or (_END, i) when the tag opens a container."""
    tag = tokens[i]
    if tag in ("N", "T", "F"):
        return {"N": None, "T": True, "F": False}[tag], i + 1
    if i + 1 >= len(tokens):
        raise CodecError("the tokens end inside a value")
    arg = tokens[i + 1]
    if tag == "i":
        return _hexint(arg), i + 2
    if tag == "f":
        return _hexfloat(arg), i + 2
    if tag == "c":
        return complex(_hexfloat(arg), _hexfloat(tokens[i + 2] if i + 2 < len(tokens) else None)), i + 3
    if tag == "s" and type(arg) is str:
        return arg, i + 2
    if tag == "b" and type(arg) is str:
        return bytes.fromhex(arg), i + 2
    if tag == "q":
        import fractions

        return fractions.Fraction(_hexint(arg), _hexint(tokens[i + 2] if i + 2 < len(tokens) else None)), i + 3
    if tag == "D" and type(arg) is str:
        import decimal

        return decimal.Decimal(arg), i + 2
    return _END, i


def _read_array(tokens, i):
    import math

    import numpy  # the caller's side: numpy is a dependency of the library

    dtype, ndim = tokens[i], _count(tokens, i + 1)
    shape = [_count(tokens, i + 2 + k) for k in range(ndim)]
    i += 2 + ndim
    items = []
    for _ in range(math.prod(shape)):
        if i >= len(tokens):
            raise CodecError("the tokens end inside an array")
        value, i = _read_scalar(tokens, i)
        if type(value) not in (bool, int, float, complex):
            raise CodecError("an array holds a value that is not a number")
        items.append(value)
    if type(dtype) is not str or numpy.dtype(dtype).kind not in "biufc":
        raise CodecError(f"an array of dtype {dtype!r}")
    return numpy.array(items, dtype=numpy.dtype(dtype)).reshape(shape), i


def decode(tokens, start=0):
    """The value that `tokens[start:]` encodes (all of them must be used); raises CodecError."""
    value, end = decode_one(tokens, start)
    if end != len(tokens):
        raise CodecError(f"{len(tokens) - end} tokens left after the value")
    return value


def decode_one(tokens, i=0):
    """(value, index after it): one value from `tokens[i:]`, with no recursion; raises CodecError."""
    if type(tokens) is not list:
        raise CodecError(f"tokens must be a list, got {type(tokens).__name__}")
    try:
        return _decode(tokens, i)
    except CodecError:
        raise
    except (ValueError, TypeError, OverflowError, ArithmeticError, IndexError, KeyError, MemoryError) as e:
        raise CodecError(f"the tokens do not decode: {type(e).__name__}: {e}") from None


def _decode(tokens, i):
    stack = []  # open containers: [tag, header, items, items still to read]
    while True:
        if i >= len(tokens):
            raise CodecError("the tokens end inside a value")
        tag = tokens[i]
        value, i = _read_scalar(tokens, i)
        if value is _END:
            if tag == "A":
                value, i = _read_array(tokens, i + 1)
            elif tag in _CONTAINERS or tag in _MAPPINGS:
                n = _count(tokens, i + 1)
                stack.append([tag, None, [], 2 * n if tag in _MAPPINGS else n])
                i += 2
            elif tag == "n":
                name, k = tokens[i + 1], _count(tokens, i + 2)
                fields = tokens[i + 3:i + 3 + k]
                if type(name) is not str or len(fields) != k or any(type(f) is not str for f in fields):
                    raise CodecError("a bad namedtuple header")
                stack.append([tag, (name, fields), [], k])
                i += 3 + k
            else:
                raise CodecError(f"unknown tag {tag!r} at token {i}")
            if len(stack) > MAX_DEPTH:
                raise CodecError(f"the value nests deeper than {MAX_DEPTH}")
            if value is _END:
                value = _pop_finished(stack)
                if value is _END:
                    continue
        while stack:  # hand the value to its container; close every container that is now full
            stack[-1][2].append(value)
            stack[-1][3] -= 1
            value = _pop_finished(stack)
            if value is _END:
                break
        else:
            return value, i


def _pop_finished(stack):
    """The value of the innermost container if it has all its items (popped), else _END."""
    if not stack or stack[-1][3] > 0:
        return _END
    tag, header, items, _ = stack.pop()
    return _finish(tag, header, items)
