"""Reading a sandboxed program's report is linear and bounded (issue 43, item 2).

A CodeEnv run writes its results on its own report fd; the caller parses them with the GIL held, so a
report built to be slow to read stalled the whole trainer. Before (8c45457): a 0.29 MB line of escaped
quotes sent the flatness regex quadratic (hours at the 4 MiB limit), 100,000 ints that hash alike took
about 80 s to put in a set, a Fraction of two 7-million-bit ints about 70 s (its gcd), and namedtuples of
100,000 fields stayed in the caller (232 MB after three verdicts) in a cache of up to 257 classes. Each
attack below is refused or read in linear time, within generous bounds here (benchmarks/report_decode.py
measures them; docs/sandbox.md states the bound); what decodes within the limits decodes as before.
"""

import gc
import json
import tracemalloc
from fractions import Fraction

import pytest

from SimpleTorchLLMRL.env import code_codec
from SimpleTorchLLMRL.env.code import parse_report
from SimpleTorchLLMRL.env.code_codec import (
    CACHED_CLASSES,
    MAX_CLASSES,
    MAX_COLLIDING,
    MAX_FIELDS,
    MAX_HEX_DIGITS,
    MAX_PART_DIGITS,
    CodecError,
    decode,
    encode,
)
from tests.support.sandbox_attack_helpers import bounded

NONCE = b"0123456789abcdef"
M61 = (1 << 61) - 1  # CPython hashes an int modulo this prime: ints that differ by it hash alike
SECONDS = 10.0  # generous: each attack reads in well under a second here when nothing else runs


def report(*lines: list) -> bytes:
    return NONCE + b"\n" + b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def parse(data: bytes, limit: float = SECONDS, seconds: float | None = None):
    call = (lambda: parse_report(data, NONCE)) if seconds is None else (lambda: parse_report(data, NONCE, seconds))
    (results, problem), took = bounded(call, limit)
    return results, problem, took


def colliding_ints(n: int) -> list:
    return [t for k in range(1, n + 1) for t in ("i", hex(k * M61))]


def test_a_line_of_escaped_quotes_is_read_in_linear_time():
    line = b'[0, "ok", "s", "' + b'\\"' * 150_000  # 0.29 MB, the string never closed
    results, problem, _ = parse(NONCE + b"\n" + line + b"\n" + b'[1, "ok", "N"]\n')
    assert results == {1: ("ok", None)} and "not a flat JSON array" in problem
    results, problem, _ = parse(report([0, "ok", "s", 'a "quoted" \\ word'], [1, "ok", "l", 1, "s", "[{"]))
    assert problem is None and results == {0: ("ok", 'a "quoted" \\ word'), 1: ("ok", ["[{"])}
    _, problem, _ = parse(NONCE + b'\n[0, "ok", "l", 1, "l", 0]\n[1, "ok", ["x"]]\n[2, "ok", {"a": 1}]\n')
    assert problem is not None  # still: nothing nested is read


@pytest.mark.parametrize("tag,per_item", [("S", 2), ("Z", 2), ("l", 2), ("t", 2), ("d", 3)])
def test_100000_ints_that_hash_alike_are_refused(tag, per_item):
    items = colliding_ints(100_000)
    if tag == "d":  # as the keys of a dict
        items = [t for k in range(0, len(items), 2) for t in (*items[k:k + 2], "N")]
    results, _, _ = parse(report([0, "ok", tag, 100_000, *items]))
    assert results[0][0] == "error" and "hash alike" in results[0][1]


def _tuple_hash(lanes: list[int]) -> int:
    """CPython's tuple hash (xxHash based, 64-bit builds) of items with these hashes."""
    p1, p2, p5, mask = 11400714785074694791, 14029467366897019727, 2870177450012600261, (1 << 64) - 1
    acc = p5
    for lane in lanes:
        acc = (acc + (lane & mask) * p2) & mask
        acc = ((acc << 31) | (acc >> 33)) & mask
        acc = (acc * p1) & mask
    acc = (acc + (len(lanes) ^ (p5 ^ 3527539))) & mask
    return acc - (1 << 64) if acc >= 1 << 63 else acc


def colliding_pairs(n: int) -> list[tuple[int, int]]:
    """n pairs (a, b) of distinct ints, none hashing like another, whose tuples all hash alike."""
    p1, p2, p5, mask = 11400714785074694791, 14029467366897019727, 2870177450012600261, (1 << 64) - 1
    target = ((_tuple_hash([0, 0]) - (2 ^ (p5 ^ 3527539))) & mask)  # the state after both lanes of (0, 0)
    before = (target * pow(p1, -1, 1 << 64)) & mask
    before = ((before >> 31) | (before << 33)) & mask  # undo the rotation
    pairs, a = [], 1
    while len(pairs) < n:
        acc = ((p5 + a * p2) & mask)
        acc = ((((acc << 31) | (acc >> 33)) & mask) * p1) & mask
        lane = ((before - acc) * pow(p2, -1, 1 << 64)) & mask
        signed = lane - (1 << 64) if lane >= 1 << 63 else lane
        if 0 <= signed < M61:  # a non-negative int hashes to itself
            pairs.append((a, signed))
        elif -M61 < signed < -2:  # a negative int to minus its absolute value
            pairs.append((a, signed))
        a += 1
    return pairs


def test_tuples_that_hash_alike_are_refused_though_their_items_do_not():
    pairs = colliding_pairs(2_000)
    assert len({hash(p) for p in pairs}) == 1 and len({h for p in pairs for h in map(hash, p)}) == 2 * len(pairs)
    tokens = [t for p in pairs for t in encode(p)]
    results, _, _ = parse(report([0, "ok", "l", len(pairs), *tokens]))  # a list: the tests may call set() on it
    assert results[0][0] == "error" and "hash alike" in results[0][1]
    few = [t for p in pairs[:MAX_COLLIDING] for t in encode(p)]  # up to the limit: read as before
    results, _, _ = parse(report([0, "ok", "S", MAX_COLLIDING, *few]))
    assert results[0] == ("ok", set(pairs[:MAX_COLLIDING]))


def test_equal_values_are_not_collisions():
    same = [10**30] * 1000 + [(1, 2)] * 1000 + [frozenset({M61, 1})] * 1000
    assert decode(encode(same)) == same
    mixed = [x for k in range(1000) for x in (k, float(k), Fraction(k), (k, 1), (float(k), 1.0))]  # equal pairs
    assert decode(encode(mixed)) == mixed
    assert decode(encode(set(range(100_000)))) == set(range(100_000))


def test_ints_and_fractions_past_their_digits_are_refused():
    big = (1 << 7_000_000) - 1
    results, _, took = parse(report([0, "ok", "q", hex(big), hex(big - 2)], [1, "ok", "i", hex(big)]))
    assert results[0][0] == "error" and "hex digits" in results[0][1]
    assert results[1][0] == "error" and "hex digits" in results[1][1]
    edge = (1 << (4 * MAX_HEX_DIGITS)) - 1
    assert decode(["i", hex(edge)]) == edge and decode(["i", hex(-edge)]) == -edge
    part = (1 << (4 * MAX_PART_DIGITS)) - 1
    assert decode(encode(Fraction(part, part - 2))) == Fraction(part, part - 2)
    with pytest.raises(CodecError, match="hex digits"):
        decode(["q", hex(part << 4), "0x3"])


def test_decimals_and_floats_past_their_text_are_refused():
    with pytest.raises(CodecError, match="exponent"):
        decode(["D", "1E+999999999"])
    with pytest.raises(CodecError, match="float string"):
        decode(["f", "0x1." + "0" * 10_000 + "p+0"])
    import decimal

    assert decode(["D", "1.5E+300"]) == decimal.Decimal("1.5E+300") and decode(["D", "NaN"]).is_nan()


def _held_after(data: bytes, times: int = 3) -> int:
    gc.collect()
    tracemalloc.start()
    for _ in range(times):
        parse_report(data, NONCE)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return held


def test_namedtuples_of_100000_fields_are_refused_and_leave_nothing():
    fields = [f"f{i}" for i in range(100_000)]
    data = report([0, "ok", "n", "T", len(fields), *fields, *["N"] * len(fields)])
    results, _, _ = parse(data)
    assert results[0][0] == "error" and f"more than {MAX_FIELDS} fields" in results[0][1]
    assert _held_after(data) < 1 << 20  # bytes the caller still holds after three verdicts
    ok = [f"f{i}" for i in range(MAX_FIELDS)]
    value = decode(["n", "Wide", MAX_FIELDS, *ok, *["i", "0x1"] * MAX_FIELDS])
    assert value == (1,) * MAX_FIELDS and value.f255 == 1


def test_namedtuple_classes_are_bounded_per_report_and_in_the_cache():
    lines = [[k, "ok", "n", f"T{k}", 2, "a", "b", "N", "N"] for k in range(300)]
    results, _, _ = parse(report(*lines))
    made = [k for k in range(300) if results[k][0] == "ok"]
    assert len(made) == MAX_CLASSES and results[MAX_CLASSES][0] == "error"
    for r in range(20):  # 20 reports of fresh classes: 320 classes made, the cache keeps the last ones
        parse(report(*[[k, "ok", "n", f"R{r}_{k}", 1, "a", "N"] for k in range(MAX_CLASSES)]))
    assert len(code_codec._NAMEDTUPLES) <= CACHED_CLASSES
    again, _, _ = parse(report(*lines[:MAX_CLASSES]))  # old classes come back as new ones, within the budget
    assert all(v[0] == "ok" for v in again.values())


def test_a_report_past_its_deadline_stops_there():
    n = 400_000
    data = report(*[[k, "ok", "l", n // 8, *["N"] * (n // 8)] for k in range(8)])  # 8 legal lines of Nones
    results, problem, took = parse(data, seconds=0.0)
    assert results == {} and "took over 0 s" in problem
    results, problem, took = parse(data, seconds=0.05)
    assert len(results) < 8 and "the rest was left out" in problem
    assert took < 0.05 + SECONDS / 2  # one line past the deadline at most (each is checked as it is read)
    results, problem, _ = parse(data)
    assert problem is None and all(v == ("ok", [None] * (n // 8)) for v in results.values())


SLOW_REPORT = '''
def total(xs):
    return None
import os, sys
_f = sys._getframe()
while _f is not None and "nonce" not in _f.f_locals:
    _f = _f.f_back
_line = b'[0, "ok", "l", 200000' + b', "l", 0' * 200000 + b']\\n'  # 1.6 MB of legal, slow-to-build values
os.write(4, _f.f_locals["nonce"] + b"\\n" + _line * 2)
os._exit(0)
'''


def test_a_verdict_never_holds_the_caller_past_the_runs_timeout():
    """The program forges a legal report as slow to read as it can make it: reading stops at the timeout."""
    from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
    from SimpleTorchLLMRL.env.code import CodeEnv
    from SimpleTorchLLMRL.env.tool_use import ToolEpisode
    from SimpleTorchLLMRL.tools.sandbox import PythonSandbox

    env = CodeEnv(PythonSandbox(timeout=1.0), workers=1)
    rollout = Rollout([Message(f"```python\n{SLOW_REPORT}\n```", MessageType.MODEL)])
    verdict, took = bounded(lambda: env.verdict(rollout, ToolEpisode(answer="assert total([1]) == 1")), 60)
    assert verdict.reward == 0.0
    assert took < 1.0 + 1.0 + 8.0  # the run, then at most its timeout of reading, and slack for a busy machine
