r"""BoxedReward against math-verify's own expected verdicts (tests/data/math_verify_cases.json).

Two ways to put a case to the reward, both reported:

- "answers" (the headline number): the reward gets the answer math-verify extracted from
  each side (`pred_answer` boxed as the completion, `gold_answer` as the ground truth;
  the raw text where it extracted none). This measures equivalence verdicts; a boxed
  reward does not read answers out of prose, by design.
- "raw texts": the completion is the case's pred as written (boxed if it has no box),
  the ground truth its gold as written. Prose such as "the number is not 10 which is
  1,000.99" then scores 0 where math-verify extracts 1,000.99.

Only cases verified with math-verify's defaults count (strict, no set-relation
comparison, float_rounding >= 5): BoxedReward runs it that way.

    uv run python tests/support/math_verify_cases.py     # prints the agreement in both modes
"""

from __future__ import annotations

import json
from pathlib import Path

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.reward import BoxedReward

CASES_FILE = Path(__file__).parents[1] / "data" / "math_verify_cases.json"


def load_cases() -> list[dict]:
    """The cases verified under math-verify's default settings (those BoxedReward uses)."""
    cases = json.loads(CASES_FILE.read_text(encoding="utf-8"))["cases"]
    return [c for c in cases if c["settings"].get("strict", True)
            and not c["settings"].get("allow_set_relation_comp", False) and c["settings"].get("precision", 6) >= 5]


def _completion(answer: str) -> Rollout:
    boxed = answer if ("\\boxed" in answer or "\\fbox" in answer) else "\\boxed{" + answer + "}"
    return Rollout([Message("question"), Message(boxed, MessageType.MODEL)])


def reward_for(case: dict, reward: BoxedReward, *, answers: bool = True) -> float:
    """The reward's value for one case (see the module docstring for `answers`)."""
    if answers:
        pred = case["pred_answer"] if case["pred_answer"] is not None else case["pred"]
        gold = case["gold_answer"] if case["gold_answer"] is not None else case["gold"]
    else:
        pred, gold = case["pred"], case["gold"]
    return reward([_completion(pred)], [gold]).item()


def agreement(use_math_verify: bool | None, *, answers: bool = True) -> tuple[float, list[dict], list[dict]]:
    """(fraction agreeing, cases rewarded though expected False, cases expected True and not rewarded)."""
    reward = BoxedReward(use_math_verify=use_math_verify)
    cases = load_cases()
    scored = [(c, reward_for(c, reward, answers=answers)) for c in cases]
    false_rewards = [c for c, r in scored if c["expected"] == 0 and r != 0.0]
    misses = [c for c, r in scored if c["expected"] == 1 and r != 1.0]
    return 1 - (len(false_rewards) + len(misses)) / len(cases), false_rewards, misses


if __name__ == "__main__":
    from SimpleTorchLLMRL.reward import math_verify_available

    modes = ([("math-verify", None)] if math_verify_available() else []) + [("fallback", False)]
    print(f"{len(load_cases())} cases (math-verify 0.9.0's tests, default settings)")
    for name, mode in modes:
        for answers in (True, False):
            share, false_rewards, misses = agreement(mode, answers=answers)
            how = "answers  " if answers else "raw texts"
            print(f"{name:11s} {how}: {100 * share:.1f}% agree; {len(false_rewards)} rewarded though expected False, "
                  f"{len(misses)} expected True not rewarded")
