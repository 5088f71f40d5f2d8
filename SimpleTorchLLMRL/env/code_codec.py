"""Values as typed data: what a sandboxed solution returns, sent back as a flat list of tokens.

    tokens = encode([1, (2.5, "x")])      # ['l', 1 ... ] -> one flat JSON array, never nested
    decode(tokens) == [1, (2.5, "x")]     # True

Both sides walk the flat list with an explicit stack, bounded by `MAX_DEPTH`; what decodes is fresh built-in
objects only (scalars, containers, namedtuples, Fraction, Decimal, numpy numbers), else `CodecError`. This
file's source also runs inside the sandbox: it imports nothing at the top.
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


# ---- decoding: linear in the tokens, whatever they hold -------------------------------------------------------

MAX_HEX_DIGITS = 1 << 16  # an int: 262,144 bits (int(s, 16) is linear; what a test does with it need not be)
MAX_PART_DIGITS = 1 << 12  # each part of a Fraction: 16,384 bits (Fraction takes their gcd)
MAX_TEXT = 1 << 12  # characters of a float's, a complex part's or a Decimal's text
MAX_EXPONENT = 1 << 16  # a Decimal's adjusted exponent, either way
MAX_FIELDS = 256  # of a namedtuple
MAX_NAME = 100  # characters of a namedtuple's type or field name
MAX_CLASSES = 16  # namedtuple classes one report may make
MAX_COLLIDING = 64  # distinct values of one report whose hashes equal another's (a set of them is quadratic)
CACHED_CLASSES = 64  # namedtuple classes kept for later reports


class Budget:
    """What decoding one report may cost: a deadline (seconds from now; None: none), new namedtuple classes,
    and values that hash alike. Ints, floats, Fractions and tuples of them hash predictably: 100,000 ints
    that all hash to 0 take minutes to put in a set, here or in the tests that call `set()` on a result.
    A value's fingerprint is the salted hash of its tokens: two values with one hash and two fingerprints
    are distinct values that collide."""

    def __init__(self, seconds=None):
        import time

        self._clock = time.monotonic
        self.deadline = None if seconds is None else self._clock() + seconds
        self.classes = 0
        self._first = {}  # hash -> (fingerprint, value) of the first value with it
        self._colliding = set()  # (hash, fingerprint) of each later distinct value with a hash seen before

    def check_time(self):
        if self.deadline is not None and self._clock() >= self.deadline:
            raise CodecError("the report took longer than its deadline to decode")

    def new_class(self):
        self.classes += 1
        if self.classes > MAX_CLASSES:
            raise CodecError(f"a report may make at most {MAX_CLASSES} namedtuple classes")

    def saw(self, value, fingerprint):
        try:
            h = hash(value)
        except TypeError:  # a tuple holding a list
            return
        first = self._first.setdefault(h, (fingerprint, value))
        if first[0] != fingerprint and (h, fingerprint) not in self._colliding and not _equal(first[1], value):
            self._colliding.add((h, fingerprint))
            if len(self._colliding) > MAX_COLLIDING:
                raise CodecError(f"more than {MAX_COLLIDING} distinct values hash alike")


def _equal(a, b):
    """a == b, False when comparing raises (1 and 1.0 hash alike, and are one value)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _hexint(s, limit=MAX_HEX_DIGITS):
    if type(s) is not str:
        raise CodecError(f"expected a hex string, got {type(s).__name__}")
    if len(s) - 2 - s.startswith("-") > limit:  # "0x", and a sign
        raise CodecError(f"an int of more than {limit} hex digits")
    return int(s, 16)


def _hexfloat(s):
    if type(s) is not str or len(s) > MAX_TEXT:
        raise CodecError(f"expected a float string, got {type(s).__name__} of {len(s) if type(s) is str else 0}")
    return float("nan") if s == "nan" else float.fromhex(s)


def _decimal(s):
    import decimal

    if type(s) is not str or len(s) > MAX_TEXT:
        raise CodecError(f"a Decimal's text must be a str of at most {MAX_TEXT} characters")
    value = decimal.Decimal(s)
    if value.is_finite() and abs(value.adjusted()) > MAX_EXPONENT:
        raise CodecError(f"a Decimal with an exponent beyond {MAX_EXPONENT}")
    return value


def _count(tokens, i):
    n = tokens[i] if i < len(tokens) else None
    if type(n) is not int or n < 0 or n > len(tokens):
        raise CodecError(f"a bad count at token {i}: {n!r}")
    return n


def _namedtuple(name, fields, budget):
    import collections

    key = (name, tuple(fields))
    cls = _NAMEDTUPLES.get(key)
    if cls is None:
        budget.new_class()
        cls = collections.namedtuple(name, fields)
        while len(_NAMEDTUPLES) >= CACHED_CLASSES:  # the oldest goes (threads may race here: never an error)
            try:
                _NAMEDTUPLES.pop(next(iter(_NAMEDTUPLES)), None)
            except (RuntimeError, StopIteration):
                break
        _NAMEDTUPLES[key] = cls
    return cls


def _finish(tag, header, items, budget):
    if tag in _CONTAINERS:
        return _CONTAINERS[tag](items)
    if tag in _MAPPINGS:  # dict(pairs) first: Counter(pairs) would count the pairs themselves
        import collections

        kind = dict if tag == "d" else getattr(collections, _MAPPINGS[tag])
        return kind(dict(zip(items[0::2], items[1::2], strict=True)))
    if tag == "n":
        return _namedtuple(header[0], header[1], budget)(*items)
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

        other = tokens[i + 2] if i + 2 < len(tokens) else None
        return fractions.Fraction(_hexint(arg, MAX_PART_DIGITS), _hexint(other, MAX_PART_DIGITS)), i + 3
    if tag == "D":
        return _decimal(arg), i + 2
    return _END, i


def _read_array(tokens, i, budget):
    import math

    import numpy  # the caller's side: numpy is a dependency of the library

    dtype, ndim = tokens[i], _count(tokens, i + 1)
    shape = [_count(tokens, i + 2 + k) for k in range(ndim)]
    i += 2 + ndim
    items = []
    for _ in range(math.prod(shape)):
        if i >= len(tokens):
            raise CodecError("the tokens end inside an array")
        start = i
        value, i = _read_scalar(tokens, i)
        if type(value) not in (bool, int, float, complex):
            raise CodecError("an array holds a value that is not a number")
        budget.saw(value, hash(tuple(tokens[start:i])))
        items.append(value)
    if type(dtype) is not str or numpy.dtype(dtype).kind not in "biufc":
        raise CodecError(f"an array of dtype {dtype!r}")
    return numpy.array(items, dtype=numpy.dtype(dtype)).reshape(shape), i


def decode(tokens, start=0, budget=None):
    """The value that `tokens[start:]` encodes (all of them must be used); raises CodecError.
    budget: what the report this value is part of may still cost (Budget); None: a fresh one, no deadline."""
    value, end = decode_one(tokens, start, budget)
    if end != len(tokens):
        raise CodecError(f"{len(tokens) - end} tokens left after the value")
    return value


def decode_one(tokens, i=0, budget=None):
    """(value, index after it): one value from `tokens[i:]`, with no recursion; raises CodecError."""
    if type(tokens) is not list:
        raise CodecError(f"tokens must be a list, got {type(tokens).__name__}")
    try:
        return _decode(tokens, i, Budget() if budget is None else budget)
    except CodecError:
        raise
    except (ValueError, TypeError, OverflowError, ArithmeticError, IndexError, KeyError, MemoryError) as e:
        raise CodecError(f"the tokens do not decode: {type(e).__name__}: {e}") from None


def _open(tokens, i, tag, stack):
    """Push the container whose tag is at i; returns the index after its header."""
    if tag in _CONTAINERS or tag in _MAPPINGS:
        n = _count(tokens, i + 1)
        stack.append([tag, None, [], 2 * n if tag in _MAPPINGS else n, [tag]])
        return i + 2
    if tag == "n":
        name, k = tokens[i + 1], _count(tokens, i + 2)
        fields = tokens[i + 3:i + 3 + k]
        if type(name) is not str or len(fields) != k or any(type(f) is not str for f in fields):
            raise CodecError("a bad namedtuple header")
        if k > MAX_FIELDS or max(map(len, (name, *fields))) > MAX_NAME:
            raise CodecError(f"a namedtuple of more than {MAX_FIELDS} fields or a name over {MAX_NAME} characters")
        stack.append([tag, (name, fields), [], k, [tag, name, *fields]])
        return i + 3 + k
    raise CodecError(f"unknown tag {tag!r} at token {i}")


_HASHABLE = ("t", "n", "Z")  # containers that can be set items or dict keys
_SALTED = (str, bytes, bool, type(None))  # values whose hash is salted per process (or one of two): never collide


def _decode(tokens, i, budget):
    stack = []  # open containers: [tag, header, items, items still to read, fingerprint parts]
    steps = 0
    while True:
        steps += 1
        if steps & 0xFFF == 0:
            budget.check_time()
        if i >= len(tokens):
            raise CodecError("the tokens end inside a value")
        start, tag = i, tokens[i]
        value, i = _read_scalar(tokens, i)
        if value is _END and tag == "A":
            value, i = _read_array(tokens, i + 1, budget)
        if value is _END:
            i = _open(tokens, i, tag, stack)
            if len(stack) > MAX_DEPTH:
                raise CodecError(f"the value nests deeper than {MAX_DEPTH}")
            if stack[-1][3] > 0:
                continue
            value, fingerprint = _pop(stack, budget)
        else:
            fingerprint = hash(tuple(tokens[start:i]))  # salted: the tag and a str (hex, text) are in it
            if type(value) not in _SALTED:
                budget.saw(value, fingerprint)
        while stack:  # hand the value to its container; close every container that is now full
            top = stack[-1]
            top[2].append(value)
            top[4].append(fingerprint)
            top[3] -= 1
            if top[3] > 0:
                break
            value, fingerprint = _pop(stack, budget)
        else:
            return value, i


def _pop(stack, budget):
    """(value, fingerprint) of the innermost container, which has all its items (popped)."""
    tag, header, items, _, parts = stack.pop()
    if tag in ("S", "Z"):  # equal sets may list their items in other orders
        parts[1:] = sorted(parts[1:])
    value, fingerprint = _finish(tag, header, items, budget), hash(tuple(parts))
    if tag in _HASHABLE:
        budget.saw(value, fingerprint)
    return value, fingerprint
