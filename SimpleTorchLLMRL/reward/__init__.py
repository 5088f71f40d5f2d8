"""Rewards: each is `reward(rollouts, ground_truths) -> torch.Tensor` of shape (B,), float32.

They read the final MODEL message of each rollout; a rollout without one gets the
reward's failure value, never an exception.
"""

from SimpleTorchLLMRL.reward.base import FunctionReward, Reward, final_model_message, make_extractor
from SimpleTorchLLMRL.reward.boxed import BoxedReward, gold_answer
from SimpleTorchLLMRL.reward.combine import CombinedReward
from SimpleTorchLLMRL.reward.format import FormatReward, tag_schema_pattern
from SimpleTorchLLMRL.reward.judge import JudgeReward
from SimpleTorchLLMRL.reward.length import LengthPenalty, OverlongPenalty
from SimpleTorchLLMRL.reward.math import extract_boxed, math_equal, math_verify_available, normalize_math
from SimpleTorchLLMRL.reward.text import ExactMatch, TokenF1, exact_match_score, f1_score, normalize_squad

__all__ = [
    "BoxedReward",
    "CombinedReward",
    "ExactMatch",
    "FormatReward",
    "FunctionReward",
    "JudgeReward",
    "LengthPenalty",
    "OverlongPenalty",
    "Reward",
    "TokenF1",
    "exact_match_score",
    "extract_boxed",
    "f1_score",
    "final_model_message",
    "gold_answer",
    "make_extractor",
    "math_equal",
    "math_verify_available",
    "normalize_math",
    "normalize_squad",
    "tag_schema_pattern",
]
