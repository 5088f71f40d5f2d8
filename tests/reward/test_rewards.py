"""Rewards against hand-computed values: boxed/math, exact match / F1, format, length, combination."""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.reward import (
    BoxedReward,
    CombinedReward,
    ExactMatch,
    FormatReward,
    FunctionReward,
    LengthPenalty,
    OverlongPenalty,
    TokenF1,
    exact_match_score,
    extract_boxed,
    f1_score,
    gold_answer,
    math_equal,
    normalize_math,
    normalize_squad,
)
from SimpleTorchLLMRL.reward import math as rmath
from SimpleTorchLLMRL.reward.numbers import to_number


def ro(*model_texts, user="question", **kw):
    """A rollout: one user turn, then MODEL turns with the given texts."""
    r = Rollout([Message(user, MessageType.MESSAGE)])
    for t in model_texts:
        r.add_messages(Message(t, MessageType.MODEL, **kw))
    return r


def empty_rollout():
    return Rollout()


# ------------------------------------------------------------------ extract_boxed

@pytest.mark.parametrize("text, expected", [
    (r"The answer is \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),
    (r"first \boxed{1} then \boxed{2}", "2"),
    (r"\boxed{1} then a truncated \boxed{2", "1"),
    (r"\boxed 5.", "5"),
    (r"$\boxed 7$", "7"),
    (r"\fbox{9}", "9"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),
    (r"\boxed{ 3 }", "3"),
    (r"\boxed{}", ""),
    ("no box here", None),
    (r"\boxed", None),
    (r"\boxedx{3}", None),
    ("", None),
    (None, None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# ------------------------------------------------------------------ math equivalence (normalizer)

EQUAL = [
    ("1/2", "0.5"), (r"\frac{1}{2}", "0.5"), (r"\dfrac12", "1/2"), (r"\tfrac{1}{2}", ".5"), (r"\frac12", "0.5"),
    ("3.0", "3"), ("+3", "3"), ("03", "3"), ("1,000", "1000"), ("1{,}000", "1000"), (r"1\,000", "1000"),
    ("12,345.5", "12345.5"), (r"5\text{ cm}", "5"), (r"5\text{ cm}^2", "5"), (r"10\mbox{ dollars}", "10"),
    ("5 apples", "5"), ("x = 3", "3"), ("y=-2", "-2"), (r"\theta = \frac{\pi}{2}", r"\frac{\pi}{2}"),
    (r"90^\circ", "90"), (r"90^{\circ}", "90"), ("90\u00b0", "90"), (r"50\%", "50"), ("$-2$", "\u22122"),
    (r"\(4\)", "4"), (r"\left( 1, 2 \right)", "(1,2)"), (r"(1, \frac{1}{2})", "(1,0.5)"), ("\u00bd", "0.5"),
    ("\uff13", "3"), (r"-\frac{3}{4}", "-0.75"), ("1e3", "1000"), (r"2\times10^{3}", "2000"),
    (r"\text{Yes}", "yes"), (r"\sqrt2", r"\sqrt{2}"), (r"\boxed{4}", "4"), ("{7}", "7"), ("7.", "7"),
    ("0.3333333333333", "1/3"),  # 1e-13 relative error, within the default rel_tol=1e-9
    (r"\pi", "\u03c0"), ("A", "a"),
]
NOT_EQUAL = [
    ("1/2", "0.49"), ("3", "4"), ("(1,2]", "(1,2)"), ("1,2", "12"), (r"2\sqrt{2}", r"\sqrt{8}"), ("", ""),
    (r"\frac{1}{0}", "1"), ("0.333", "1/3"), ("-3", "3"), ("x", "y"), ("(1,2)", "(2,1)"), ("10", "1,0"),
]


@pytest.mark.parametrize("a, b", EQUAL)
def test_fallback_equal(a, b):
    assert math_equal(a, b, use_math_verify=False)
    assert math_equal(b, a, use_math_verify=False)


@pytest.mark.parametrize("a, b", NOT_EQUAL)
def test_fallback_not_equal(a, b):
    assert not math_equal(a, b, use_math_verify=False)
    assert not math_equal(b, a, use_math_verify=False)


def test_normalize_math_exact_strings():
    assert normalize_math(r"$x = \dfrac{1}{2}\text{ m}$") == r"\frac{1}{2}"
    assert normalize_math(r"\left[ 1, 2 \right)") == "[1,2)"
    assert normalize_math("1,000,000") == "1000000"
    assert normalize_math("The Answer.") == "theanswer"


def test_rel_tol_and_exact_rationals():
    assert to_number(r"\frac{2}{4}") == Fraction(1, 2)
    assert to_number("-0.125") == Fraction(-1, 8)
    assert to_number("abc") is None
    assert math_equal("0.3333333333333", "1/3", use_math_verify=False)
    assert not math_equal("0.3333333333333", "1/3", use_math_verify=False, rel_tol=0.0)


def test_hostile_numbers_do_not_hang_or_raise():
    assert to_number("1e999999999") is None
    assert to_number("1" * 5000) is None  # over Python's int-digit limit: string compare only
    assert math_equal("1" * 5000, "1" * 5000, use_math_verify=False)
    assert not math_equal(r"\frac{1}{" * 50, "1", use_math_verify=False)


def test_hostile_boxes_take_linear_time():
    import time

    texts = [r"\boxed{" * 3000, r"x \boxed{1}" + r"\boxed{ab" * 5000, "{" * 5000 + "}" * 5000, "x=" + "1 " * 5000 + "apples"]
    start = time.perf_counter()
    assert extract_boxed(texts[0]) is None and extract_boxed(texts[1]) == "1"
    for t in texts:
        math_equal(t, t + "1", use_math_verify=False)
    assert time.perf_counter() - start < 1.0  # each was seconds with quadratic scans


@given(st.integers(-10**6, 10**6), st.integers(1, 10**4))
@settings(max_examples=60, deadline=None)
def test_fraction_forms_agree(p, q):
    frac = Fraction(p, q)
    n, d = frac.numerator, frac.denominator
    forms = [rf"\frac{{{n}}}{{{d}}}", f"{n}/{d}", rf"\dfrac{{{n}}}{{{d}}}"] if d > 1 else [str(n)]
    for a in forms:
        assert math_equal(a, forms[0], use_math_verify=False)
    if 10**6 % d == 0:  # terminating decimal with <= 6 places
        assert math_equal(f"{float(frac):.6f}", forms[-1], use_math_verify=False)
    if (p, q) != (n, d):  # an unevaluated fraction is not an answer to a numeric gold
        assert not math_equal(rf"\frac{{{p}}}{{{q}}}", forms[0], use_math_verify=False)


@given(st.text(max_size=60))
@settings(max_examples=150, deadline=None)
def test_arbitrary_text_never_raises(text):
    extract_boxed(text)
    normalize_math(text)
    r = BoxedReward(correct=2.0, incorrect=-1.0, no_answer=-0.5, use_math_verify=False)
    gold = text if text.strip() else "1"  # a blank gold is refused (issue 34); any other text is an answer
    out = r([ro(text), ro(rf"\boxed{{{text}}}")], ["1", gold])
    assert out.shape == (2,) and set(out.tolist()) <= {2.0, -1.0, -0.5}
    for reward in (TokenF1(extract=r"<a>(.*)</a>"), ExactMatch(keep_numbers=True), FormatReward.from_tags(["a"])):
        assert 0.0 <= reward([ro(text)], [text if text.strip() else "x"]).item() <= 1.0


# ------------------------------------------------------------------ math-verify integration

def test_math_verify_real_if_installed():
    pytest.importorskip("math_verify")
    assert math_equal(r"2\sqrt{2}", r"\sqrt{8}", use_math_verify=True)
    assert not math_equal("3", "4", use_math_verify=True)
    assert BoxedReward(use_math_verify=True)([ro(r"\boxed{\sqrt{8}}")], [r"2\sqrt{2}"]).tolist() == [1.0]


def test_use_math_verify_true_without_package_says_how_to_install():
    if rmath.math_verify_available():
        pytest.skip("math-verify is installed")
    with pytest.raises(ImportError, match="uv sync --extra math"):
        BoxedReward(use_math_verify=True)
    with pytest.raises(ImportError, match="uv sync --extra math"):
        rmath.math_verify_equal("1", "1")


@pytest.fixture
def fake_math_verify(monkeypatch):
    """math-verify 'installed', its verdicts scripted: {(pred, gold): True | False | None}, recording the calls."""
    verdicts, calls = {}, []
    monkeypatch.setattr(rmath, "math_verify_available", lambda: True)
    monkeypatch.setattr(rmath, "_import_math_verify", lambda: None)

    def ask(gold, pred, timeout):
        calls.append((gold, pred, timeout))
        return verdicts.get((pred, gold))

    monkeypatch.setattr(rmath, "ask_math_verify", ask)
    return verdicts, calls


def test_math_verify_verdict_is_final_and_asked_gold_first(fake_math_verify):
    verdicts, calls = fake_math_verify
    verdicts[("A", "B")] = True
    assert math_equal("A", "B") and calls[-1] == ("B", "A", 5.0)
    verdicts[("(x, 1/2)", "(x, 0.5)")] = False
    assert not math_equal("(x, 1/2)", "(x, 0.5)")  # math-verify's False wins over the normalizer's True
    assert math_equal("(x, 1/2)", "(x, 0.5)", use_math_verify=False)
    assert math_equal("x+1", "x + 1")  # no verdict (None): the normalizer decides
    assert math_equal("C", "D", timeout=2.5) is False and calls[-1] == ("D", "C", 2.5)


def test_rules_decide_numbers_before_math_verify(fake_math_verify):
    verdicts, calls = fake_math_verify
    verdicts[("1/2", "0.5")] = False
    verdicts[(r"645 \times 49", "31605")] = True
    assert math_equal("1/2", "0.5") and not math_equal(r"645 \times 49", "31605")
    assert calls == []  # numbers against a numeric gold never reach math-verify


def test_costly_answers_skip_math_verify(fake_math_verify):
    verdicts, calls = fake_math_verify
    for tower in (r"9^{9^{9}}", "9^9^9", r"2^{100000}", "1000!", "(5!)!"):
        assert rmath.too_costly(tower)
        assert not math_equal(tower, r"\sqrt{2}")
    assert calls == [] and not rmath.too_costly(r"2^{10} + 3!")


# ------------------------------------------------------------------ BoxedReward

def test_boxed_reward_values_shape_dtype():
    rollouts = [
        ro(r"so \boxed{\frac{1}{2}}"),          # correct
        ro(r"\boxed{3}"),                       # wrong
        ro("I think it is 5"),                   # no box
        Rollout([Message("q")]),                 # no MODEL message
        empty_rollout(),                         # nothing at all
        ro(r"\boxed{}"),                         # empty box = no answer
    ]
    r = BoxedReward(correct=1.0, incorrect=-0.5, no_answer=-1.0, use_math_verify=False)
    out = r(rollouts, ["0.5", "4", "5", "1", "1", "1"])
    assert out.dtype == torch.float32 and out.shape == (6,)
    assert out.tolist() == [1.0, -0.5, -1.0, -1.0, -1.0, -1.0]


def test_boxed_reward_reads_only_the_final_model_message():
    r = Rollout([Message("q"), Message(r"\boxed{4}", MessageType.MODEL), Message("tool says hi", MessageType.TOOL),
                 Message("let me reconsider", MessageType.MODEL), Message(r"user: \boxed{4}", MessageType.MESSAGE)])
    assert BoxedReward(use_math_verify=False)([r], ["4"]).tolist() == [0.0]
    r.add_messages(Message(r"final \boxed{4}", MessageType.MODEL))
    assert BoxedReward(use_math_verify=False)([r], ["4"]).tolist() == [1.0]


@pytest.mark.parametrize("gold", ["72", 72, 72.0, r"so \boxed{72}", "Janet sells... #### 72", ["71", "72"], "72.00"])
def test_boxed_reward_ground_truth_forms(gold):
    assert BoxedReward(use_math_verify=False)([ro(r"\boxed{72}")], [gold]).tolist() == [1.0]


@pytest.mark.parametrize("pred, gold", [
    (r"\boxed{\dfrac12}", "0.5"), (r"\boxed{1,000}", "1000"), (r"\boxed{x = 5}", "5"), (r"\boxed{3.0}", "3"),
    (r"\boxed{12\text{ apples}}", "12"), (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
    ("\\boxed{\u22124}", "-4"), (r"\boxed 5", "5"),
])
def test_boxed_reward_equivalences(pred, gold):
    assert BoxedReward(use_math_verify=False)([ro(pred)], [gold]).tolist() == [1.0]


def test_gold_answer():
    assert gold_answer(r"x \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert gold_answer("step 1 ... #### 1,234") == "1,234"
    assert gold_answer(3.0) == "3" and gold_answer(None) is None


def test_reward_batch_errors():
    r = BoxedReward(use_math_verify=False)
    with pytest.raises(ValueError, match="same length"):
        r([ro("a"), ro("b")], ["1"])
    with pytest.raises(TypeError, match="single Rollout"):
        r(ro("a"), ["1"])
    with pytest.raises(TypeError, match="single str"):
        r([ro("a")], "1")
    assert r([], []).shape == (0,)
    with pytest.raises(ValueError, match="ground truth"):
        r([ro(r"\boxed{1}")], [None])
    with pytest.raises(ValueError, match="row 0 is missing"):  # refused whatever the model wrote (issue 34)
        r([Rollout()], [None])
    assert r([Rollout()], ["1"]).tolist() == [0.0]  # no MODEL message: the failure value
    with pytest.raises(ValueError, match="correct"):
        BoxedReward(correct=float("nan"))
    with pytest.raises(ValueError, match="use_math_verify"):
        BoxedReward(use_math_verify="yes")


# ------------------------------------------------------------------ exact match / F1

def test_normalize_squad():
    assert normalize_squad("The  Cat, sat!") == "cat sat"
    assert normalize_squad("An apple a day") == "apple day"
    assert normalize_squad("-3.5 degrees") == "35 degrees"
    assert normalize_squad("-3.5 degrees", keep_numbers=True) == "-3.5 degrees"
    assert normalize_squad("$1,000.50 well-known end.", keep_numbers=True) == "1000.50 wellknown end"
    assert normalize_squad("x-3 and +2", keep_numbers=True) == "x3 and +2"
    assert normalize_squad("Café MÜLLER") == "café müller"


def test_f1_hand_computed():
    # pred [cat, cat, sat] vs gold [cat, sat, on, mat]: overlap 2 (cat counted once), P=2/3, R=2/4
    assert f1_score("the cat the cat sat", "cat sat on the mat") == pytest.approx(4 / 7, abs=1e-12)
    # repeated tokens: [x, x, x, y] vs [x, x]: overlap 2, P=1/2, R=1 -> 2/3
    assert f1_score("x x x y", "x x") == pytest.approx(2 / 3, abs=1e-12)
    assert f1_score("x x", "x x x y") == pytest.approx(2 / 3, abs=1e-12)
    assert f1_score("Paris", "paris.") == 1.0
    assert f1_score("", "paris") == 0.0 and f1_score("the", "a") == 1.0  # both normalize to empty
    assert f1_score("london", "paris") == 0.0
    # the Router-R1 variant: signs and decimal points survive
    assert f1_score("-3.5 degrees", "3.5") == pytest.approx(2 / 3)
    assert f1_score("-3.5 degrees", "3.5", keep_numbers=True) == 0.0
    assert exact_match_score("-3.5", "3.5") == 1.0 and exact_match_score("-3.5", "3.5", keep_numbers=True) == 0.0


def test_exact_match_and_f1_rewards():
    tagged = r"<answer>(.*?)</answer>"
    rollouts = [
        ro("<think>hmm</think><answer>The Eiffel Tower</answer>"),
        ro("<answer>old</answer> then <answer>New York</answer>"),  # the last <answer> counts
        ro("no tags at all"),
        Rollout([Message("q")]),
        ro("<answer>Café</answer>"),
    ]
    golds = ["eiffel tower", ["NYC", "new york city"], "x", "x", "cafe"]
    em = ExactMatch(extract=tagged, no_answer=-1.0)
    assert em(rollouts, golds).tolist() == [1.0, 0.0, -1.0, -1.0, 0.0]
    f1 = TokenF1(extract=tagged, scale=2.0)
    # "new york" vs "new york city": P=1, R=2/3 -> 0.8 ; best over the gold list
    expected = [2.0, 2 * 0.8, 0.0, 0.0, 0.0]
    assert f1(rollouts, golds).tolist() == pytest.approx(expected)
    assert ExactMatch()([ro("Paris.")], ["paris"]).tolist() == [1.0]
    with pytest.raises(ValueError, match="ground truth"):
        ExactMatch()([ro("a")], [None])
    with pytest.raises(ValueError, match="regex"):
        ExactMatch(extract="(")
    with pytest.raises(ValueError, match="keep_numbers"):
        TokenF1(keep_numbers="yes")


def test_text_reward_with_callable_extract():
    r = ExactMatch(extract=lambda t: t.split("ANSWER:")[-1] if "ANSWER:" in t else None)
    assert r([ro("blah ANSWER: 42"), ro("42")], ["42", "42"]).tolist() == [1.0, 0.0]


# ------------------------------------------------------------------ format

def test_regex_format_modes():
    texts = [ro("<a>1</a>"), ro("pre <a>1</a> post"), ro("<a>1</a> post")]
    assert FormatReward(r"<a>.*?</a>")(texts).tolist() == [1.0, 0.0, 0.0]
    assert FormatReward(r"<a>.*?</a>", mode="search")(texts).tolist() == [1.0, 1.0, 1.0]
    assert FormatReward(r"<a>.*?</a>", mode="match")(texts).tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="mode"):
        FormatReward("x", mode="full")
    with pytest.raises(ValueError, match="pattern"):
        FormatReward("(")


@pytest.mark.parametrize("text, strict, loose, partial", [
    ("<think>a\nb</think>\n<answer>4</answer>", 1.0, 1.0, 1.0),
    ("  <think></think><answer>4</answer>\n", 1.0, 1.0, 1.0),
    ("Sure! <think>a</think><answer>4</answer>", 0.0, 1.0, 2 / 3),    # text outside: only loose matches
    ("<answer>4</answer><think>a</think>", 0.0, 0.0, 2 / 3),           # wrong order; each tag well-formed
    ("<think>a</think><answer>4</answer><answer>5</answer>", 0.0, 1.0, 1 / 3),
    ("<think>a<think>b</think></think><answer>4</answer>", 0.0, 0.0, 1 / 3),
    ("<think>a</think>", 0.0, 0.0, 1 / 3),
    ("</think>a<think>", 0.0, 0.0, 0.0),                                 # close before open
    ("", 0.0, 0.0, 0.0),
])
def test_tag_schema(text, strict, loose, partial):
    r = ro(text)
    assert FormatReward.from_tags(["think", "answer"])([r]).tolist() == [strict]
    assert FormatReward.from_tags(["think", "answer"], strict=False)([r]).tolist() == [loose]
    got = FormatReward.from_tags(["think", "answer"], partial=True)([r]).item()
    assert got == pytest.approx(partial)


def test_tag_schema_validation_and_no_model_message():
    with pytest.raises(ValueError, match="tag names"):
        FormatReward.from_tags(["th ink"])
    with pytest.raises(ValueError, match="distinct"):
        FormatReward.from_tags(["a", "a"])
    with pytest.raises(ValueError, match="non-empty"):
        FormatReward.from_tags("think")
    r = FormatReward.from_tags(["think"], correct=1.0, incorrect=-1.0)
    assert r([empty_rollout(), ro("<think>x</think>")]).tolist() == [-1.0, 1.0]


# ------------------------------------------------------------------ length

def model_msg(n, content=None):
    return Message(content or "x" * n, MessageType.MODEL, token_ids=list(range(n)))


def test_length_penalty_hand_values():
    r = LengthPenalty(max_length=20, min_length=10, penalty=0.5)
    rollouts = [Rollout([Message("q"), model_msg(n)]) for n in (0, 10, 15, 20, 30)]
    assert r(rollouts).tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.5])
    assert r([empty_rollout()]).tolist() == [0.0]


def test_overlong_penalty_dapo_values():
    r = OverlongPenalty(max_length=10, cache_length=4)  # safe up to 6
    lengths = [0, 6, 7, 8, 10, 11, 100]
    rollouts = [Rollout([Message("q"), model_msg(n)]) for n in lengths]
    assert r(rollouts).tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    hard = OverlongPenalty(max_length=10, cache_length=0, penalty=2.0)
    assert hard([Rollout([model_msg(10)]), Rollout([model_msg(11)])]).tolist() == [0.0, -2.0]
    with pytest.raises(ValueError, match="cache_length"):
        OverlongPenalty(max_length=10, cache_length=11)
    with pytest.raises(ValueError, match="max_length"):
        LengthPenalty(max_length=5, min_length=5)


def test_length_units_scope_and_tokenizer(chatml_tokenizer):
    multi = Rollout([Message("q"), model_msg(3), Message("tool", MessageType.TOOL), model_msg(5)])
    assert LengthPenalty(10)([multi]).tolist() == pytest.approx([-0.5])
    assert LengthPenalty(10, scope="all")([multi]).tolist() == pytest.approx([-0.8])
    text = Rollout([Message("hello world", MessageType.MODEL)])  # no token_ids
    with pytest.raises(ValueError, match="tokenizer"):
        LengthPenalty(10)([text])
    assert LengthPenalty(22, unit="chars")([text]).tolist() == pytest.approx([-0.5])
    n = len(chatml_tokenizer("hello world", add_special_tokens=False)["input_ids"])
    assert LengthPenalty(10, tokenizer=chatml_tokenizer)([text]).tolist() == pytest.approx([-n / 10])
    with pytest.raises(ValueError, match="scope"):
        LengthPenalty(10, scope="first")


# ------------------------------------------------------------------ combination

def test_combined_reward_total_and_components():
    boxed = BoxedReward(use_math_verify=False)
    fmt = FormatReward(r".*\\boxed\{.*\}.*")
    contains = FunctionReward(lambda text, gt: float(str(gt) in text), name="contains")

    def constant(rollouts, ground_truths):
        return torch.full((len(rollouts),), 0.25, dtype=torch.float64)

    comb = CombinedReward([(boxed, 1.0), (fmt, 0.1), (contains, -2.0), (constant, 4.0), (boxed, 0.5)])
    assert comb.names == ["boxed", "format", "contains", "constant", "boxed_1"]
    rollouts = [ro(r"\boxed{4}"), ro(r"\boxed{5}"), ro("4"), Rollout([Message("q")])]
    total, parts = comb.compute(rollouts, ["4", "4", "4", "4"])
    assert parts["boxed"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert parts["format"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert parts["contains"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert parts["constant"].dtype == torch.float32
    expected = [1 + 0.1 - 2 + 1 + 0.5, 0.1 + 1, -2 + 1, 1.0]
    assert total.dtype == torch.float32 and total.tolist() == pytest.approx(expected, abs=1e-6)
    assert comb(rollouts, ["4"] * 4).tolist() == total.tolist()
    assert comb.last_components.keys() == parts.keys()
    assert comb.metrics()["reward/boxed"] == pytest.approx(0.25)


def test_combined_reward_errors():
    with pytest.raises(ValueError, match="non-empty"):
        CombinedReward([])
    with pytest.raises(ValueError, match="weight"):
        CombinedReward([(BoxedReward(), math.inf)])
    with pytest.raises(ValueError, match="pair"):
        CombinedReward([BoxedReward()])
    with pytest.raises(ValueError, match="names"):
        CombinedReward([(BoxedReward(), 1.0), (BoxedReward(), 1.0)], names=["a", "a"])
    bad = CombinedReward([(lambda rs, gts: torch.zeros(len(rs), 2), 1.0)])
    with pytest.raises(ValueError, match="shape"):
        bad([ro("a")], ["1"])
    with pytest.raises(ValueError, match="same length"):
        CombinedReward([(BoxedReward(), 1.0)])([ro("a")], ["1", "2"])
