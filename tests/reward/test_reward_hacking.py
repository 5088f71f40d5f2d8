r"""Issue 16, items 10 and 13: no unearned math reward, in both modes; the fallback's documented scope.

"Both modes": with math-verify (when installed) and with the pure-Python fallback
(`use_math_verify=False`, which is also what runs where math-verify is absent).
"""

import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.reward import (
    BoxedReward,
    ExactMatch,
    TokenF1,
    gold_answer,
    math_equal,
    math_verify_available,
)
from SimpleTorchLLMRL.reward import math as rmath
from tests.support.math_verify_cases import agreement, load_cases

MODES = [pytest.param(False, id="fallback"),
         pytest.param(None, id="math-verify",
                      marks=pytest.mark.skipif(not math_verify_available(), reason="math-verify not installed"))]


def boxed(text, gold, mode):
    rollout = Rollout([Message("question"), Message(text, MessageType.MODEL)])
    return BoxedReward(use_math_verify=mode)([rollout], [gold]).item()


HACKS = [  # (completion, gold): each earned a reward before
    (r"\boxed{645 \times 49}", "31605"),               # restating the question
    (r"\boxed{645 \cdot 49}", "31605"),
    (r"\boxed{\sqrt{4}}", "2"),
    (r"\boxed{\frac{63210}{2}}", "31605"),             # an unevaluated division
    (r"\boxed{12345678901}", "12345678902"),           # a relative tolerance on integers
    (r"\boxed{32, 349}", "32349"),                     # a list read as thousands
    (r"\boxed{17 \text{ (or 18)}}", "17"),             # hedges stripped as units
    (r"\boxed{17 or eighteen}", "17"),
    (r"\boxed{17 \text{ or } 18}", "18"),
    (r"\boxed{5 is not the answer}", "5"),
    (r"\boxed{5 eighteen}", "5"),
    (r"\boxed{17} or \boxed{18}", "18"),               # two boxed candidates are a list, not a lucky guess
    (r"\boxed{-2}", r"\(\boxed{1}\) and \(\boxed{-2}\)"),  # a gold with several boxes is all of them
    (r"\boxed{1}", r"\boxed{1},\boxed{2}"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("completion, gold", HACKS)
def test_no_reward_for_hacks(completion, gold, mode):
    assert boxed(completion, gold, mode) == 0.0


EARNED = [  # what the rules above must still accept
    (r"\boxed{31605}", "31605"), (r"\boxed{31,605}", "31605"), (r"\boxed{645 \times 49 = 31605}", "31605"),
    (r"\boxed{x = 31605}", "31605"), (r"\boxed{12345678902}", "12345678902"), (r"\boxed{5 apples}", "5"),
    (r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{1, -2}", r"\(\boxed{1}\) and \(\boxed{-2}\)"),
    (r"\boxed{-2} and \boxed{1}", r"\boxed{1},\boxed{-2}"), (r"\boxed{\{1, 2\}}", r"\boxed{1},\boxed{2}"),
    (r"\boxed{17} ... so \boxed{17}", "17"), (r"\boxed{(11,7) or (7,11)}", "(11,7) or (7,11)"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("completion, gold", EARNED)
def test_earned_rewards_still_paid(completion, gold, mode):
    assert boxed(completion, gold, mode) == 1.0


def test_gold_with_several_boxes_is_their_list():
    assert gold_answer(r"\(\boxed{1}\) and \(\boxed{-2}\).") == "1, -2"
    assert gold_answer(r"\boxed{4} so \boxed{4}") == "4"
    assert gold_answer(r"\boxed{1} no no no \boxed{2}") == "2"  # not joined: the last run of boxes (as math-verify)


def test_math_verify_false_is_not_overruled_by_the_fallback(monkeypatch):
    monkeypatch.setattr(rmath, "math_verify_available", lambda: True)
    monkeypatch.setattr(rmath, "_import_math_verify", lambda: None)
    monkeypatch.setattr(rmath, "ask_math_verify", lambda gold, pred, timeout: False)
    assert rmath.fallback_equal("(x, 1/2)", "(x, 0.5)")
    assert not math_equal("(x, 1/2)", "(x, 0.5)")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("answer, gold", [
    (r"\cfrac{1}{3}", "1/3"), (r"\left(\frac13\right)", "1/3"), ("$28$ %", r"$28\%$"), (r"5\textnormal{ miles}", "5"),
])
def test_fallback_gaps_closed(answer, gold, mode):  # item 13
    assert math_equal(answer, gold, use_math_verify=mode)


@pytest.mark.parametrize("mode", MODES)
def test_no_reward_for_any_expected_false_case_of_math_verify(mode):
    for answers in (True, False):
        _, false_rewards, _ = agreement(mode, answers=answers)
        assert false_rewards == [], [(c["gold"], c["pred"]) for c in false_rewards]


@pytest.mark.skipif(not math_verify_available(), reason="math-verify not installed")
def test_agreement_with_math_verify_expected_verdicts():
    share, _, misses = agreement(None)
    assert len(load_cases()) == 270 and share >= 0.97, [(c["gold_answer"], c["pred_answer"]) for c in misses]


# ------------------------------------------------------------------ issue 34: a missing ground truth is no answer

def _missing_golds():
    """Ground truths that are no answer: what pandas gives for an empty cell, None, blank text, empty lists."""
    import numpy as np
    import pandas as pd

    return [
        pytest.param(float("nan"), "NaN", id="float-nan"),
        pytest.param(np.float64("nan"), "NaN", id="numpy-float64-nan"),
        pytest.param(np.float32("nan"), "NaN", id="numpy-float32-nan"),
        pytest.param(pd.read_csv(__import__("io").StringIO("q,a\nx,\n")).a[0], "NaN", id="pandas-empty-cell"),
        pytest.param(pd.NA, "pandas <NA>", id="pandas-NA"),
        pytest.param(pd.NaT, "pandas NaT", id="pandas-NaT"),
        pytest.param(None, "None", id="None"),
        pytest.param("", "blank string", id="empty-string"),
        pytest.param(" \n", "blank string", id="blank-string"),
        pytest.param([], "empty list", id="empty-list"),
        pytest.param(["12", np.nan], "answer 1 of its list is NaN", id="nan-in-list"),
        pytest.param(("12", pd.NA), "answer 1 of its list is pandas <NA>", id="NA-in-tuple"),
    ]


def _answer_like(gold):
    """What a naive reward reads the missing gold as (its str), so that matching it would earn a reward."""
    return str(gold[-1] if isinstance(gold, (list, tuple)) and gold else gold)


def _batch_with(text, gold):
    """Row 0 is fine; row 1 carries the missing gold."""
    good = Rollout([Message("question"), Message(r"\boxed{7} 7", MessageType.MODEL)])
    bad = Rollout([Message("question"), Message(text, MessageType.MODEL)])
    return [good, bad], ["7", gold]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("gold", "what"), _missing_golds())
def test_boxed_reward_refuses_a_missing_gold_naming_the_row(gold, what, mode):
    rollouts, golds = _batch_with(rf"\boxed{{{_answer_like(gold)}}}", gold)
    with pytest.raises(ValueError, match=rf"ground truth of row 1 is missing: .*{what}"):
        BoxedReward(use_math_verify=mode)(rollouts, golds)


@pytest.mark.parametrize("reward_cls", [ExactMatch, TokenF1])
@pytest.mark.parametrize(("gold", "what"), _missing_golds())
def test_text_rewards_refuse_a_missing_gold_naming_the_row(gold, what, reward_cls):
    rollouts, golds = _batch_with(_answer_like(gold), gold)  # "NaN" against NaN scored 1.0
    with pytest.raises(ValueError, match=rf"ground truth of row 1 is missing: .*{what}"):
        reward_cls()(rollouts, golds)


@pytest.mark.parametrize("reward", [BoxedReward(use_math_verify=False), ExactMatch(), TokenF1()], ids=str)
def test_a_missing_gold_is_refused_whatever_the_model_wrote(reward):
    no_answer = Rollout([Message("question"), Message("I do not know", MessageType.MODEL)])
    silent = Rollout([Message("question")])  # no MODEL message at all
    for rollouts in ([no_answer], [silent]):
        with pytest.raises(ValueError, match="row 0 is missing: it is NaN"):
            reward(rollouts, [float("nan")])
    with pytest.raises(ValueError, match="needs ground_truths"):
        reward([no_answer], None)


def test_real_answers_still_score_as_before():
    def ro(text):
        return Rollout([Message("question"), Message(text, MessageType.MODEL)])

    boxed_ = BoxedReward(use_math_verify=False)
    assert boxed_([ro(r"\boxed{3}"), ro(r"\boxed{0}"), ro(r"\boxed{5}"), ro("no box")],
                  [3.0, 0, ["4", "5"], "1"]).tolist() == [1.0, 1.0, 1.0, 0.0]
    # the text "nan" is an answer like any other (a question about IEEE floats); only a float NaN is missing
    assert ExactMatch()([ro("NaN"), ro("nan"), ro("Paris")], ["nan", "NaN", ("London", "Paris")]).tolist() == [1, 1, 1]
    assert TokenF1()([ro("nan value"), ro("0")], ["NaN", 0]).tolist() == [pytest.approx(2 / 3), 1.0]
    assert boxed_.is_correct("7", ["7"]) and not boxed_.is_correct("7", "8")
    with pytest.raises(ValueError, match="a ground truth is missing: it is NaN"):  # called alone: no row to name
        boxed_.is_correct("nan", float("nan"))


def test_a_numpy_array_of_answers_is_a_list_of_answers():
    np = pytest.importorskip("numpy")
    from SimpleTorchLLMRL.reward.base import answers_of

    assert answers_of(np.array(["12", "twelve"], dtype=object)) == ["12", "twelve"]  # not the text "['12' ...]"
    with pytest.raises(ValueError, match="row 4.*NaN"):
        answers_of(np.array([1.5, np.nan]), row=4)


@pytest.mark.parametrize("gold", [float("nan"), None, "  "])
def test_math_equal_matches_nothing_against_a_missing_gold(gold):
    assert not rmath.math_equal("nan", gold) and not rmath.math_equal("nan", gold, use_math_verify=False)
    assert rmath.math_equal("nan", "nan")  # the text is an answer like any other
