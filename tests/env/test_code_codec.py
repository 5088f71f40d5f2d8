"""The typed-data codec CodeEnv's results travel in: values round-trip and compare as Python compares the
originals; tokens a program forged decode to a value or a CodecError, never anything else, at any depth."""

import collections
import decimal
import fractions
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from SimpleTorchLLMRL.env.code_codec import MAX_DEPTH, CodecError, decode, encode

Point = collections.namedtuple("Point", "x y")

VALUES = [
    None, True, False, 0, -7, 2**200, -(2**70), 1.5, -0.0, float("inf"), float("-inf"), 1e-310, 3 + 4j,
    "", "é\n\x00\ud800", b"\x00\xff", [], (), {}, set(), frozenset(), [1, (2, [3, {4: "x"}])],
    {(1, 2): frozenset({3}), "k": None}, collections.Counter("aab"), collections.OrderedDict([("b", 1), ("a", 2)]),
    Point(1, [2]), fractions.Fraction(1, 3), decimal.Decimal("1.10"), {1, 2.5, "s", (1,)},
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_values_round_trip_through_json_with_their_types(value):
    tokens = json.loads(json.dumps(encode(value)))  # what the report channel carries
    back = decode(tokens)
    assert back == value and type(back) is type(value) or (isinstance(value, Point) and tuple(back) == value)
    if isinstance(value, float):
        assert math.copysign(1, back) == math.copysign(1, value)


def test_decoded_values_compare_as_python_compares_the_originals():
    assert decode(encode(collections.Counter("aab"))) == {"a": 2, "b": 1}  # a Counter equals the dict
    assert decode(encode(Point(1, 2))) == (1, 2) and decode(encode(Point(1, 2))).x == 1
    assert decode(encode(collections.defaultdict(list, {"a": [1]}))) == {"a": [1]}
    assert decode(encode(np.int64(5))) == 5 and type(decode(encode(np.int64(5)))) is int
    assert decode(encode(np.float32(0.5))) == 0.5 and decode(encode(np.bool_(True))) is True
    nan = decode(encode(float("nan")))
    assert nan != nan  # nan stays nan: it equals nothing, as in Python
    array = decode(encode(np.arange(6, dtype=np.int16).reshape(2, 3)))
    assert array.dtype == np.int16 and array.shape == (2, 3) and array.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert decode(encode(fractions.Fraction(1, 2))) == 0.5


class EqualToEverything:
    def __eq__(self, other):
        return True


@pytest.mark.parametrize("value", [EqualToEverything(), [1, EqualToEverything()], object(), len, iter([1]),
                                   np.array([object()]), type("MyInt", (int,), {})(3)])
def test_what_is_not_plain_data_does_not_travel(value):
    with pytest.raises(CodecError):
        encode(value)


def test_nesting_is_bounded_both_ways_without_recursion():
    deep = []
    for _ in range(MAX_DEPTH - 1):
        deep = [deep]
    assert decode(encode(deep)) == deep
    cyclic = []
    cyclic.append(cyclic)
    with pytest.raises(CodecError, match="deeper"):
        encode(cyclic)
    with pytest.raises(CodecError, match="deeper"):  # 100,000 open lists: no RecursionError, no stack
        decode(["l", 1] * 100_000 + ["N"])


@pytest.mark.parametrize("tokens", [
    [], ["l"], ["l", 2, "N"], ["l", -1], ["l", 10**9], ["i", "zz"], ["i", 5], ["f", "x"], ["s", 3], ["?"],
    ["d", 1, ["i"], "N"], ["S", 1, "l", 0], ["d", 1, "l", 0, "N"], ["n", "P", 1, "x"], ["n", "1bad", 1, "x", "N"],
    ["A", "|O", 1, 1, "N"], ["A", "<i8", 1, 2, "i", "0x1"], ["N", "N"], "not a list", ["q", "0x1", "0x0"],
])
def test_malformed_tokens_are_a_codec_error(tokens):
    with pytest.raises(CodecError):
        decode(tokens)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(["N", "T", "F", "i", "f", "c", "s", "b", "l", "t", "S", "Z", "d", "o",
                                           "C", "n", "q", "D", "A", "0x1", "nan", "inf", "<f8"]),
                          st.integers(-3, 5), st.text(max_size=3)), max_size=30))
def test_any_token_list_decodes_or_is_a_codec_error(tokens):
    try:
        decode(tokens)
    except CodecError:
        pass
