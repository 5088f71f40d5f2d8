"""SFT and DPO from rollouts: float64 references written from the papers' formulas (values and gradients),
micro-batches that add up to the full batch, and the peft reference (adapter off) equal to the base model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.testing.tiny import TINY_CALC
from SimpleTorchLLMRL.trainer.dpo import DPO, DPOConfig, dpo_loss
from SimpleTorchLLMRL.trainer.losses import LossInputs, combine_metrics
from SimpleTorchLLMRL.trainer.sft import SFT, SFTConfig, sft_loss
from tests.support.losses_helpers import (
    assert_grads_close,
    grads,
    make_rollouts,
    naive_logprobs,
    perturbed_copy,
)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(TINY_CALC, dtype=torch.float32)


@pytest.fixture
def ref(model):
    torch.manual_seed(1)
    return perturbed_copy(model, 0.05).eval()


def _logits(seed=0, B=4, T=5, V=7):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.7).long()
    mask[:, 0], mask[:, 1] = 0, 1
    return z, y, mask


def _close_to_float64(g32, g64):
    """float32 gradients against float64 ones: within 1e-3 relative and 1e-4 of each tensor's largest entry."""
    for n in g32:
        scale = float(g64[n].abs().max())
        torch.testing.assert_close(g32[n].double(), g64[n].double(), rtol=1e-3, atol=1e-4 * scale + 1e-12,
                                   msg=lambda m, n=n: f"{n}: {m}")


# ---------------------------------------------------------------- SFT


def test_sft_loss_is_the_cross_entropy_of_the_trained_tokens():
    z, y, mask = _logits()
    lp = torch.log_softmax(z, -1).gather(-1, y[..., None])[..., 0]
    out = sft_loss(LossInputs.from_tokens(mask, logprobs=lp), SFTConfig())
    (g,) = torch.autograd.grad(out.loss, z)
    m = mask.bool()
    ref = F.cross_entropy(z[m], y[m])  # the mean over the trained tokens
    (g_ref,) = torch.autograd.grad(ref, z)
    torch.testing.assert_close(out.loss, ref, rtol=1e-7, atol=1e-10)  # float32 weights 1 / count
    torch.testing.assert_close(g, g_ref, rtol=1e-7, atol=1e-10)
    assert float(out.metrics["nll"]) == pytest.approx(float(ref.detach()), rel=1e-6)
    seq = sft_loss(LossInputs.from_tokens(mask, logprobs=lp), SFTConfig("sequence_mean_token_mean")).loss
    per_row = [F.cross_entropy(z[b][m[b]], y[b][m[b]]) for b in range(4)]
    assert float(seq) == pytest.approx(float(sum(per_row) / 4), rel=1e-7)


def test_sft_front_matches_float64_and_micro_batches(model, calc_tok):
    rollouts = make_rollouts(2, 3)
    sft = SFT(model, calc_tok)
    prepared = sft.prepare(rollouts)
    full = sft.compute(prepared)
    full.loss.backward()
    g_full = grads(model)
    m64 = copy.deepcopy(model).double()
    lp = naive_logprobs(m64, prepared.batch)
    m = prepared.mask.bool()
    ref = -lp[m].mean()
    ref.backward()
    assert float(full.loss) == pytest.approx(float(ref), rel=1e-5)
    _close_to_float64(g_full, {n: p.grad for n, p in m64.named_parameters()})
    model.zero_grad()
    parts = []
    for mb in prepared.split(4):
        out = sft.compute(mb)
        out.loss.backward()
        parts.append(out.metrics)
    assert_grads_close(grads(model), g_full, rtol=1e-4, atol=1e-7)
    combined = combine_metrics(parts)
    assert float(combined["loss"]) == pytest.approx(float(full.metrics["loss"]), rel=1e-5)
    assert float(combined["nll"]) == pytest.approx(float(full.metrics["nll"]), rel=1e-5)
    assert int(combined["num_tokens"]) == int(m.sum())


def test_sft_mixes_with_grpo_as_a_weighted_sum(model, calc_tok):
    from SimpleTorchLLMRL.trainer.grpo import GRPO

    rollouts, demos = make_rollouts(2, 2), make_rollouts(1, 1)
    grpo, sft = GRPO(model, calc_tok, group_size=2), SFT(model, calc_tok)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    (grpo.calculate_loss(rollouts, rewards) + 0.1 * sft.calculate_loss(demos)).backward()
    mixed = grads(model)
    model.zero_grad()
    grpo.calculate_loss(rollouts, rewards).backward()
    g_rl = grads(model)
    model.zero_grad()
    sft.calculate_loss(demos).backward()
    g_sft = grads(model)
    assert_grads_close(mixed, {n: g_rl[n] + 0.1 * g_sft[n] for n in mixed}, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- DPO: the unit


def _dpo_reference(pi, ref, mask, beta, variant, eps):
    """From the papers: h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)), sequence sums (IPO: means)."""
    m = mask.double()
    agg = (lambda x: (x * m).sum(-1) / m.sum(-1)) if variant == "ipo" else (lambda x: (x * m).sum(-1))
    s, r = agg(pi), agg(ref)
    h = (s[0::2] - r[0::2]) - (s[1::2] - r[1::2])
    sig = torch.sigmoid
    if variant == "sigmoid":  # DPO; cDPO: the label is flipped with probability eps
        loss = -(1 - eps) * torch.log(sig(beta * h)) - eps * torch.log(sig(-beta * h))
    elif variant == "robust":  # rDPO: the unbiased loss under label noise eps
        loss = ((1 - eps) * -torch.log(sig(beta * h)) - eps * -torch.log(sig(-beta * h))) / (1 - 2 * eps)
    else:  # IPO: a regression of h onto 1 / (2 beta)
        loss = (h - 1 / (2 * beta)) ** 2
    return loss.mean(), h


@pytest.mark.parametrize("variant, eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.2), ("ipo", 0.0)])
def test_dpo_loss_matches_float64_reference(variant, eps):
    z, y, mask = _logits(seed=1)
    lp = torch.log_softmax(z, -1).gather(-1, y[..., None])[..., 0]
    ref_lp = torch.log_softmax(torch.randn(z.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64),
                               -1).gather(-1, y[..., None])[..., 0]
    out = dpo_loss(LossInputs.from_tokens(mask, logprobs=lp, ref_logprobs=ref_lp), DPOConfig(0.3, variant, eps))
    (g,) = torch.autograd.grad(out.loss, z)
    lp = torch.log_softmax(z, -1).gather(-1, y[..., None])[..., 0]
    expected, h = _dpo_reference(lp, ref_lp, mask, 0.3, variant, eps)
    (g_ref,) = torch.autograd.grad(expected, z)
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-14)
    assert float(out.metrics["reward_margin"]) == pytest.approx(float(0.3 * h.mean()), rel=1e-6)
    assert float(out.metrics["reward_accuracy"]) == pytest.approx(float((h > 0).double().mean()))


def test_dpo_options_and_pairs_are_checked(model, calc_tok, ref):
    with pytest.raises(ValueError, match="variant"):
        DPO(model, calc_tok, ref_model=ref, variant="hinge")
    with pytest.raises(ValueError, match="label_smoothing"):
        DPO(model, calc_tok, ref_model=ref, variant="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="reference"):
        DPO(model, calc_tok)  # not a peft model: a reference is needed
    dpo = DPO(model, calc_tok, ref_model=ref)
    r = make_rollouts(2, 2)
    with pytest.raises(ValueError, match="different prompts"):
        dpo.calculate_loss([r[0]], [r[2]])
    with pytest.raises(ValueError, match="as many chosen"):
        dpo.calculate_loss(r[:2], r[2:3])
    with pytest.raises(ValueError, match="whole pairs"):
        dpo.compute(dpo.prepare(r[0::2], r[1::2]).split(3)[0])


# ---------------------------------------------------------------- DPO: the front on the tiny model


@pytest.mark.parametrize("variant, eps", [("sigmoid", 0.1), ("ipo", 0.0)])
def test_dpo_front_matches_float64_and_micro_batches(model, calc_tok, ref, variant, eps):
    r = make_rollouts(2, 4)  # pairs (0, 1), (2, 3) of each prompt
    chosen, rejected = r[0::2], r[1::2]
    dpo = DPO(model, calc_tok, ref_model=ref, beta=0.2, variant=variant, label_smoothing=eps)
    prepared = dpo.prepare(chosen, rejected)
    full = dpo.compute(prepared)
    full.loss.backward()
    g_full = grads(model)
    m64 = copy.deepcopy(model).double()
    with torch.no_grad():
        ref_lp = naive_logprobs(copy.deepcopy(ref).double(), prepared.batch)
    expected, _ = _dpo_reference(naive_logprobs(m64, prepared.batch), ref_lp, prepared.mask, 0.2, variant, eps)
    expected.backward()
    assert float(full.loss) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
    _close_to_float64(g_full, {n: p.grad for n, p in m64.named_parameters()})
    model.zero_grad()
    parts = []
    for mb in prepared.split(2):  # one pair per micro-batch
        out = dpo.compute(mb)
        out.loss.backward()
        parts.append(out.metrics)
    assert_grads_close(grads(model), g_full, rtol=1e-4, atol=1e-6)  # float32 sums in another order
    combined = combine_metrics(parts)
    for key in ("loss", "reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward", "num_sequences"):
        assert float(combined[key]) == pytest.approx(float(full.metrics[key]), rel=1e-5, abs=1e-7), key


def test_peft_reference_with_the_adapter_off_equals_the_base_model(model, calc_tok):
    from SimpleTorchLLMRL.model.lora import apply_lora

    base = copy.deepcopy(model).eval()
    policy = apply_lora(model, r=4, alpha=8)
    with torch.no_grad():  # a trained adapter: the policy differs from its base
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.add_(0.05 * torch.randn_like(p))
    r = make_rollouts(2, 2)
    with_adapter_off = DPO(policy, calc_tok).prepare(r[0::2], r[1::2])
    with_base = DPO(policy, calc_tok, ref_model=base).prepare(r[0::2], r[1::2])
    torch.testing.assert_close(with_adapter_off.ref_logprobs, with_base.ref_logprobs, rtol=0, atol=1e-6)
    out = DPO(policy, calc_tok).compute(with_adapter_off)
    assert float(out.metrics["reward_margin"]) != 0.0  # the adapter moved the policy off the reference
    assert all(p.requires_grad == ("lora_" in n) for n, p in policy.named_parameters())


def test_multi_turn_pairs_train_only_their_model_turns(model, calc_tok, ref):
    prompt = [Message("What is 3 * (4 + 5)?")]
    good = Rollout(prompt + [Message("The answer is \\boxed{27}.", MessageType.MODEL)])
    bad = Rollout(prompt + [Message("I do not know the answer", MessageType.MODEL), Message("Try again")])
    prepared = DPO(model, calc_tok, ref_model=ref).prepare([good], [bad])
    ids = prepared.batch.input_ids[1][prepared.mask[1].bool()].tolist()
    assert calc_tok.decode(ids).startswith("I do not know the answer")
    assert "Try again" not in calc_tok.decode(ids)


def test_a_pair_whose_rendered_prompts_differ_is_refused(model, calc_tok, ref):
    """Tools in one rollout's metadata render a longer prompt (gateway rollouts always carry them): the pair's
    text matched, so the loss came back 0.693 before; now a ValueError naming the pair."""
    question = [Message("What is 312 + 85?")]
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}}}}]
    chosen = Rollout(question + [Message("The answer is \\boxed{397}.", MessageType.MODEL)], {"tools": tools})
    rejected = Rollout(question + [Message("The answer is \\boxed{407}.", MessageType.MODEL)])
    dpo = DPO(model, calc_tok, ref_model=ref)
    with pytest.raises(ValueError, match="DPO pair 0: .*different prompts .*tools and template arguments"):
        dpo.calculate_loss([chosen], [rejected])
    same = Rollout(question + [Message("The answer is \\boxed{407}.", MessageType.MODEL)], {"tools": tools})
    assert torch.isfinite(dpo.calculate_loss([chosen], [same]))  # the same tools: one prompt
