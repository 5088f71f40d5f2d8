"""Issue 16's loss items: dropout off for exact on-policy ratios, Dr. GRPO's fixed constant, TRL's KL bias correction."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from SimpleTorchLLMRL.model.dropout import active_dropout, disable_dropout
from SimpleTorchLLMRL.testing.tiny import tiny_model
from SimpleTorchLLMRL.trainer.grpo import GRPO
from SimpleTorchLLMRL.trainer.ppo import PPO
from tests.support.losses_helpers import (
    batch_of,
    make_rollouts,
    naive_logprobs,
    perturbed_copy,
    trained_positions,
    with_sampled_logprobs,
)

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 2.0])


def _gpt2_with_dropout(tokenizer):
    model = tiny_model("gpt2", tokenizer)  # GPT-2's config: 0.1 dropout on embeddings, attention, residuals
    assert model.config.attn_pdrop == 0.1
    return model.train()


def _on_policy(model, tok):
    return with_sampled_logprobs(make_rollouts(2, 3, system=False), model.eval(), tok, temperature=1.0)


def test_dropout_breaks_on_policy_ratios_and_disable_dropout_restores_them(plain_tokenizer):
    torch.manual_seed(0)
    model = _gpt2_with_dropout(plain_tokenizer)
    rollouts = _on_policy(model, plain_tokenizer)
    model.train()
    grpo = GRPO(model, plain_tokenizer, group_size=3)
    with pytest.warns(UserWarning, match="dropout on"):
        grpo.calculate_loss(rollouts, REWARDS)
    assert grpo.metrics["ratio_max"] - grpo.metrics["ratio_min"] > 0.01  # a random sub-network, not the policy
    assert active_dropout(model)
    disable_dropout(model).train()
    assert active_dropout(model) == [] and model.config.attn_pdrop == 0.0
    grpo = GRPO(model, plain_tokenizer, group_size=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grpo.calculate_loss(rollouts, REWARDS)
    assert grpo.metrics["ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert grpo.metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5) and grpo.metrics["clip_frac"] == 0.0


def test_the_dropout_warning_comes_once_per_trainer_and_from_ppo_too(plain_tokenizer):
    model = _gpt2_with_dropout(plain_tokenizer)
    rollouts = _on_policy(model, plain_tokenizer)
    model.train()
    ppo = PPO(model, plain_tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ppo.calculate_loss(rollouts, REWARDS)
        ppo.calculate_loss(rollouts, REWARDS)
    assert sum("dropout on" in str(w.message) for w in caught) == 1


def test_disable_dropout_reaches_lora_dropout(chatml_tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("qwen2", chatml_tokenizer),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    assert any("lora_dropout" in n for n in active_dropout(model))
    assert active_dropout(disable_dropout(model)) == []


def test_dr_grpo_needs_its_fixed_constant(qwen2_model, chatml_tokenizer):
    with pytest.raises(ValueError, match="max_tokens="):
        GRPO(qwen2_model, chatml_tokenizer, loss_type="dr_grpo")


def test_dr_grpo_normalizer_does_not_move_with_the_batch(qwen2_model, chatml_tokenizer):
    grpo = GRPO(qwen2_model, chatml_tokenizer, loss_type="dr_grpo", max_tokens=64, group_size=3)
    short = make_rollouts(2, 3)
    long = copy.deepcopy(short)
    long[0].messages[-1].content += " and a much longer reply that makes this batch's longest span grow"
    assert grpo.normalizer_for(short) == grpo.normalizer_for(long) == 6 * 64


def test_kl_bias_correction_multiplies_the_kl_by_the_ratio(qwen2_model, chatml_tokenizer):
    """TRL's use_bias_correction_kl: per-token k3 KL x pi/pi_old, against a float64 reference."""
    model, tok = qwen2_model, chatml_tokenizer
    ref_model = perturbed_copy(model)
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), model, tok, temperature=1.0, shift=0.3)
    rewards = torch.zeros(6)  # zero advantages: the loss is the KL term alone
    grpo = GRPO(model, tok, beta=0.1, ref_model=ref_model, loss_type="bnpo", group_size=3, kl_bias_correction=True)
    loss = grpo.calculate_loss(rollouts, rewards)
    batch = batch_of(rollouts, tok)
    m = trained_positions(batch).bool()
    with torch.no_grad():
        lp, ref = naive_logprobs(model, batch)[m], naive_logprobs(ref_model, batch)[m]
    old = batch.sampler_logprobs[m].double()
    d = ref - lp
    naive = 0.1 * ((torch.exp(d) - d - 1) * torch.exp(lp - old)).mean()
    torch.testing.assert_close(loss.detach().double(), naive, rtol=1e-4, atol=1e-7)
    plain = GRPO(model, tok, beta=0.1, ref_model=ref_model, loss_type="bnpo", group_size=3).calculate_loss(
        rollouts, rewards)
    assert abs(float(plain) - float(loss)) > 1e-4  # ratios exp(0.3): the correction changes the loss
