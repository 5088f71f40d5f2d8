"""Papercuts a new user meets: clear errors, one default temperature, warnings at the user's line."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
from SimpleTorchLLMRL.model.scoring.head import check_vocabulary
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer
from SimpleTorchLLMRL.trainer.grpo import GRPO
from SimpleTorchLLMRL.trainer.ppo import PPO, PPOConfig


def _rollouts(n=4):
    return [Rollout([Message("Add 2 and 3.", MessageType.MESSAGE)]) for _ in range(n)]


def test_a_tokenizer_larger_than_the_model_is_an_error_naming_both_sizes(chatml_tokenizer):
    small = tiny_model("qwen2", vocab_size=len(chatml_tokenizer) - 10)
    for build in (lambda: GRPO(small, chatml_tokenizer), lambda: PPO(small, chatml_tokenizer),
                  lambda: ModelGenerate(small, chatml_tokenizer)):
        with pytest.raises(ValueError, match=rf"{len(chatml_tokenizer)} tokens but the model scores only "
                                             rf"{len(chatml_tokenizer) - 10}"):
            build()


def test_a_much_larger_model_vocabulary_warns(chatml_tokenizer):
    big = tiny_model("qwen2", vocab_size=len(chatml_tokenizer) + 5000)
    with pytest.warns(UserWarning, match="is it the model's own tokenizer"):
        check_vocabulary(big, chatml_tokenizer)
    padded = tiny_model("qwen2", vocab_size=len(chatml_tokenizer) + 300)  # Qwen-style padding: silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_vocabulary(padded, chatml_tokenizer)


def test_the_policy_as_its_own_reference_is_an_error(qwen2_model, chatml_tokenizer):
    for cls in (GRPO, PPO):
        with pytest.raises(ValueError, match="ref_model is the policy itself"):
            cls(qwen2_model, chatml_tokenizer, beta=0.1, ref_model=qwen2_model)


def test_default_generator_and_default_loss_agree_on_temperature(qwen2_model, chatml_tokenizer):
    """ModelGenerate samples at 0.7 by default; GRPO follows the recorded temperature without a warning."""
    gen = ModelGenerate(qwen2_model, chatml_tokenizer, max_new_tokens=4, seed=0)
    rollouts = _rollouts()
    gen.batch_rollout_generate_response(rollouts)
    grpo = GRPO(qwen2_model, chatml_tokenizer, group_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grpo.calculate_loss(rollouts, torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert grpo.metrics["temperature"] == pytest.approx(0.7)
    with pytest.warns(UserWarning, match="pass temperature=0.7"):  # an explicit, different one still says so
        GRPO(qwen2_model, chatml_tokenizer, group_size=4, temperature=1.0).calculate_loss(
            rollouts, torch.tensor([1.0, 0.0, 0.0, 1.0]))


def test_library_warnings_point_at_the_callers_line(qwen2_model, chatml_tokenizer):
    gen = ModelGenerate(qwen2_model, chatml_tokenizer, max_new_tokens=3, seed=0)
    rollouts = [Rollout([Message(f"question {i}", MessageType.MESSAGE)]) for i in range(3)]
    gen.batch_rollout_generate_response(rollouts)
    with pytest.warns(UserWarning, match="alone in their group") as record:
        GRPO(qwen2_model, chatml_tokenizer).calculate_loss(rollouts, torch.tensor([1.0, 0.0, 1.0]))
    assert record[0].filename == __file__


def test_ppo_options_are_in_its_signature():
    params = inspect.signature(PPO).parameters
    config_fields = set(PPOConfig.__dataclass_fields__) - {"clip"}
    assert config_fields <= set(params), sorted(config_fields - set(params))
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_ppo_reports_the_same_ratio_diagnostics_as_grpo(qwen2_model, chatml_tokenizer):
    gen = ModelGenerate(qwen2_model, chatml_tokenizer, max_new_tokens=4, seed=0)
    rollouts = _rollouts()
    gen.batch_rollout_generate_response(rollouts)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    grpo, ppo = GRPO(qwen2_model, chatml_tokenizer, group_size=4), PPO(qwen2_model, chatml_tokenizer)
    grpo.calculate_loss(rollouts, rewards)
    ppo.calculate_loss(rollouts, rewards)
    shared = {"clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max", "entropy",
              "num_tokens", "temperature"}
    assert shared <= set(grpo.metrics) and shared <= set(ppo.metrics)
    assert ppo.metrics["ratio_min"] <= ppo.metrics["ratio_mean"] <= ppo.metrics["ratio_max"]


def test_tiny_tokenizer_model_pair_is_silent():
    tok = tiny_tokenizer("chatml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_vocabulary(tiny_model("qwen2", tok), tok)
