"""Off-policy correction (`trainer.off_policy`) against float64 references written from each source's formula.

The sampler's log-probs are the model's own plus N(0, 0.5^2) noise per token (a mismatched
sampler), and the model moves a little between `prepare` and the loss (an epoch later), so the
ratio, the correction weight and the DeepSeek-V3.2 KL (against the current policy) all differ.
"""

import math

import pytest
import torch

from SimpleTorchLLMRL.chat.message import MessageType
from SimpleTorchLLMRL.trainer.grpo import GRPO
from SimpleTorchLLMRL.trainer.losses import SUM, LazyMetrics, combine_metrics, mismatch_metrics
from SimpleTorchLLMRL.trainer.off_policy import OffPolicy, correction_weights
from SimpleTorchLLMRL.trainer.ppo import PPO
from tests.support.losses_helpers import (
    assert_grads_close,
    grads,
    make_rollouts,
    naive_logprobs,
    with_sampled_logprobs,
)

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 2.0])
CONFIGS = {
    "tis": OffPolicy.tis(1.2),
    "token_truncate_both": OffPolicy("token", "truncate", low=0.8, high=1.25),
    "icepop": OffPolicy.icepop(0.8, 1.25),
    "token_reject": OffPolicy("token", "reject", low=0.8, high=1.25),
    "sequence_truncate": OffPolicy("sequence", "truncate", high=2.0),
    "sequence_mask": OffPolicy("sequence", "mask", low=0.3, high=3.0),
    "geometric_mask": OffPolicy.geometric_mask(0.88, 1.12),
    "deepseek": OffPolicy.deepseek(0.05),
    "tis_and_deepseek": OffPolicy("token", "truncate", high=1.5, kl_threshold=0.05),
}
MISMATCH = ("offpolicy_kl_k1", "offpolicy_kl_k3", "offpolicy_chi2_token", "offpolicy_chi2_seq", "offpolicy_ess",
            "offpolicy_ppl_ratio")
CORRECTION = ("tis_weight_mean", "offpolicy_clipped_frac", "offpolicy_masked_frac", "offpolicy_masked_seq_frac")


# ---------------------------------------------------------------- float64 references, from the formulas


def ref_weights(op: OffPolicy, trainer, sampled, mask, adv, current):
    """(B, T) float64 weight of each trained token (1 elsewhere), row by row from the module's formulas.

    rho_t = pi_trainer / pi_sampler; token: rho_t, sequence: prod_t rho_t, geometric: (prod_t rho_t)^(1/|o|);
    truncate: clamp to [low, high]; mask: rho on [low, high], else 0 (TRL token/sequence_mask, IcePop);
    reject: 1 on [low, high], else 0 (verl rollout_rs); DeepSeek-V3.2: 0 where A < 0 and
    mean_t (log pi_sampler - log pi_current) > delta."""
    w = torch.ones_like(trainer, dtype=torch.float64)
    for i in range(trainer.shape[0]):
        idx = mask[i].bool() & ~torch.isnan(sampled[i])
        log_rho = trainer[i, idx].double() - sampled[i, idx].double()
        if op.level is not None:
            rho = {"token": torch.exp(log_rho), "sequence": torch.exp(log_rho.sum()).expand_as(log_rho),
                   "geometric": torch.exp(log_rho.mean()).expand_as(log_rho)}[op.level]
            low = op.low if op.low is not None else (0.0 if op.mode == "truncate" else 1 / op.high)
            inside = (rho >= low) & (rho <= op.high)
            w[i, idx] = {"truncate": rho.clamp(low, op.high), "mask": torch.where(inside, rho, 0.0),
                         "reject": inside.double()}[op.mode]
        if op.kl_threshold is not None:
            kl = (sampled[i, idx].double() - current[i, idx].double()).mean()
            a = adv[i] if adv.dim() == 1 else adv[i, idx]
            drop = (torch.as_tensor(a) < 0) & (kl > op.kl_threshold)
            w[i, idx] = torch.where(drop, 0.0, w[i, idx])
    return w


def ref_grpo_loss(lp, old, A, mask, w, eps=0.2):
    """GRPO: mean over rows of the row's token mean of w_t * -min(r_t A, clip(r_t) A), r = exp(lp - old)."""
    rows = []
    for i in range(lp.shape[0]):
        idx = mask[i].bool()
        r = torch.exp(lp[i, idx] - old[i, idx].double())
        rows.append((w[i, idx] * -torch.minimum(r * A[i], r.clamp(1 - eps, 1 + eps) * A[i])).mean())
    return torch.stack(rows).mean()


def ref_mismatch(trainer, sampled, mask):
    """verl's diagnostics in float64 over the trained tokens with a sampler log-prob."""
    m = mask.bool() & ~torch.isnan(sampled)
    log_rho = torch.where(m, trainer.double() - torch.where(m, sampled, 0).double(), 0.0)
    t = log_rho[mask.bool()]
    rho = torch.exp(t)
    seq = torch.exp(2 * log_rho.sum(1))
    return {"offpolicy_kl_k1": float((-t).mean()), "offpolicy_kl_k3": float((rho - 1 - t).mean()),
            "offpolicy_chi2_token": float((rho ** 2).mean() - 1), "offpolicy_chi2_seq": float(seq.mean() - 1),
            "offpolicy_ess": float(rho.mean() ** 2 / (rho ** 2).mean()),
            "offpolicy_ppl_ratio": float(torch.exp(-t.mean()))}


# ---------------------------------------------------------------- helpers


def noisy_sampler(model, tok, sigma=0.5, seed=0, offsets=(0.0, 0.3, 0.0, 0.0, 0.3, 0.0)):
    """Rollouts whose MODEL turns carry log-probs = the model's + offset of the rollout + N(0, sigma^2) per
    token (clamped to <= 0). The offsets put rollouts 1 and 4 (negative advantages) far from the trainer."""
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), model, tok, temperature=1.0)
    g = torch.Generator().manual_seed(seed)
    for r, offset in zip(rollouts, offsets, strict=True):
        for m in r:
            if m.type is MessageType.MODEL:
                noise = offset + sigma * torch.randn(len(m.logprobs), generator=g, dtype=torch.float64)
                m.logprobs = (torch.tensor(m.logprobs, dtype=torch.float64) + noise).clamp(max=0).tolist()
    return rollouts


def nudge(model, scale=0.02, seed=1):
    """Move every weight a little, in place: the policy an update later."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))


def group_advantages(rewards, group=3, eps=1e-4):
    r = rewards.double().view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).flatten()


# ---------------------------------------------------------------- GRPO


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_grpo_correction_matches_float64_values_and_gradients(name, fused, qwen2_model, chatml_tokenizer):
    model, tok, op = qwen2_model, chatml_tokenizer, CONFIGS[name]
    grpo = GRPO(model, tok, group_size=3, off_policy=op, fused=fused)
    prepared = grpo.prepare(noisy_sampler(model, tok), REWARDS)
    batch, mask = prepared.batch, prepared.mask
    with torch.no_grad():
        old = naive_logprobs(model, batch)  # the trainer at sampling time
    nudge(model)
    loss = grpo.calculate_loss(prepared)
    loss.backward()
    mine = grads(model)
    model.zero_grad()
    lp = naive_logprobs(model, batch)
    A = group_advantages(REWARDS)
    w = ref_weights(op, old, batch.sampler_logprobs, mask, A, lp.detach())
    m = mask.bool()
    assert (w[m] != 1).any() and (w[m] != 0).any(), "the correction must bind somewhere, and not everywhere"
    ref = ref_grpo_loss(lp, old, A, mask, w)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-4, atol=1e-6)
    assert_grads_close(mine, grads(model))
    metrics = grpo.metrics
    assert metrics["tis_weight_mean"] == pytest.approx(float(w[m].mean()), rel=1e-4)
    zero = w[m] == 0
    assert metrics["offpolicy_masked_frac"] == pytest.approx(float(zero.double().mean()), abs=1e-6)
    per_row = torch.tensor([bool((w[i][m[i]] == 0).all()) for i in range(len(w))])
    assert metrics["offpolicy_masked_seq_frac"] == pytest.approx(float(per_row.double().mean()), abs=1e-6)
    if op.mode == "truncate" and op.level is not None:
        low = op.low if op.low is not None else 0.0
        rho = ref_weights(OffPolicy(op.level, "truncate", None, 1e30), old, batch.sampler_logprobs, mask, A, lp)
        clipped = (rho[m] < low) | (rho[m] > op.high)
        assert metrics["offpolicy_clipped_frac"] == pytest.approx(float(clipped.double().mean()), abs=1e-6)
    for key, value in ref_mismatch(old, batch.sampler_logprobs, mask).items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("name", ["tis", "icepop", "sequence_mask", "geometric_mask", "tis_and_deepseek"])
def test_grpo_micro_batches_equal_the_full_batch(name, qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    grpo = GRPO(model, tok, group_size=3, off_policy=CONFIGS[name], loss_type="bnpo")
    prepared = grpo.prepare(noisy_sampler(model, tok), REWARDS)
    nudge(model)
    full = grpo.compute(prepared)
    full.loss.backward()
    g_full = grads(model)
    model.zero_grad()
    outs = [grpo.compute(mb) for mb in prepared.split(2)]
    for out in outs:
        out.loss.backward()
    assert_grads_close(grads(model), g_full, rtol=1e-4, atol=1e-7)
    combined = combine_metrics([o.metrics for o in outs])
    for key in ("loss", *MISMATCH, *CORRECTION):
        assert combined[key] == pytest.approx(full.metrics[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("name", list(CONFIGS))
def test_on_policy_weights_are_one_and_the_loss_is_uncorrected(name, qwen2_model, chatml_tokenizer):
    """Sampler == trainer: every ratio is 1 (to float32 rounding), nothing is masked, the loss is plain GRPO's."""
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), model, tok, temperature=1.0)
    op = CONFIGS[name]
    if op.level == "geometric":
        op = OffPolicy.geometric_mask(0.999, 1.001)
    if op.kl_threshold is not None:
        op = OffPolicy(op.level, op.mode, op.low, op.high, kl_threshold=1e-3)
    plain = GRPO(model, tok, group_size=3)
    corrected = GRPO(model, tok, group_size=3, off_policy=op)
    torch.testing.assert_close(corrected.calculate_loss(rollouts, REWARDS), plain.calculate_loss(rollouts, REWARDS),
                               rtol=1e-5, atol=1e-7)
    m = corrected.metrics
    assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["offpolicy_masked_frac"] == 0 and m["offpolicy_masked_seq_frac"] == 0
    assert abs(m["offpolicy_kl_k1"]) < 1e-5 and m["offpolicy_kl_k3"] < 1e-9
    assert m["offpolicy_ess"] == pytest.approx(1.0, abs=1e-6) and m["offpolicy_ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert "offpolicy_kl_k1" in plain.metrics and "tis_weight_mean" not in plain.metrics  # diagnostics always


def test_a_dict_of_fields_works_and_bad_options_name_the_problem(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    assert PPO(model, tok, off_policy=OffPolicy.tis(1.5)).config.off_policy == OffPolicy("token", "truncate", None, 1.5)
    assert GRPO(model, tok, off_policy={"level": "geometric", "mode": "reject", "low": 0.9, "high": 1.1}
                ).config.off_policy == OffPolicy.geometric_mask(0.9, 1.1)
    for kwargs, match in [({"level": "tokens"}, "level="), ({"mode": "clip"}, "mode="),
                          ({"low": 2.0, "high": 1.0}, "below high"), ({"high": 0}, "high="),
                          ({"level": None}, "nothing to correct"), ({"kl_threshold": -1}, "kl_threshold")]:
        with pytest.raises(ValueError, match=match):
            OffPolicy(**kwargs)
    with pytest.raises(ValueError, match="off_policy="):
        GRPO(model, tok, off_policy="icepop")


# ---------------------------------------------------------------- PPO


@pytest.mark.parametrize("name", ["tis", "icepop", "sequence_truncate", "geometric_mask", "deepseek"])
def test_ppo_policy_loss_matches_float64(name, qwen2_model, chatml_tokenizer):
    """PPO's token-mean policy loss: sum_t w_t * -min(r_t A_t, clip(r_t) A_t) / N, with per-token advantages."""
    model, tok, op = qwen2_model, chatml_tokenizer, CONFIGS[name]
    ppo = PPO(model, tok, off_policy=op, cliprange_value=None)
    prepared = ppo.prepare(noisy_sampler(model, tok), REWARDS)
    batch, mask = prepared.batch, prepared.mask
    nudge(model)
    out = ppo.compute(prepared)
    with torch.no_grad():
        lp = naive_logprobs(model, batch)
    old, A, m = prepared.old_logprobs.double(), prepared.advantages.double(), mask.bool()
    w = ref_weights(op, old, batch.sampler_logprobs, mask, A, lp)
    assert (w[m] != 1).any()
    r = torch.exp(lp - old)
    per_token = w * -torch.minimum(r * A, r.clamp(0.8, 1.2) * A)
    assert out.metrics["policy_loss"] == pytest.approx(float(per_token[m].sum() / m.sum()), rel=1e-4, abs=1e-6)
    assert out.metrics["tis_weight_mean"] == pytest.approx(float(w[m].mean()), rel=1e-4)
    for key, value in ref_mismatch(old, batch.sampler_logprobs, mask).items():
        assert out.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_ppo_on_policy_correction_changes_nothing(qwen2_model, chatml_tokenizer):
    model, tok = qwen2_model, chatml_tokenizer
    rollouts = with_sampled_logprobs(make_rollouts(2, 3), model, tok, temperature=1.0)
    torch.manual_seed(0)
    plain = PPO(model, tok)
    torch.manual_seed(0)
    corrected = PPO(model, tok, off_policy=OffPolicy.icepop(0.5, 2.0))
    torch.testing.assert_close(corrected.calculate_loss(rollouts, REWARDS), plain.calculate_loss(rollouts, REWARDS),
                               rtol=1e-5, atol=1e-7)
    assert corrected.metrics["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert corrected.metrics["offpolicy_masked_frac"] == 0


def test_deepseek_mask_reads_the_current_policy_and_the_advantage_sign():
    """Two rollouts of two tokens; the KL is mean_t (log pi_sampler - log pi_current), not the trainer's old."""
    sampled = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    old = sampled.clone()  # trainer == sampler at sampling time: rho = 1
    current = torch.tensor([-1.5, -1.5, -1.5, -1.5])  # the policy moved: KL estimate 0.5 on both rollouts
    row = torch.tensor([0, 0, 1, 1])
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0])
    w, stats = correction_weights(OffPolicy.deepseek(0.4), old, sampled, row, 2, adv, current)
    assert w.tolist() == [0.0, 0.0, 1.0, 1.0] and stats["row_masked"].tolist() == [True, False]
    w, _ = correction_weights(OffPolicy.deepseek(0.6), old, sampled, row, 2, adv, current)
    assert w.tolist() == [1.0, 1.0, 1.0, 1.0]
    unknown = torch.tensor([-1.0, float("nan"), -1.0, -1.0])  # an unknown token is left out of the mean
    w, _ = correction_weights(OffPolicy.deepseek(0.4), old, unknown, row, 2, adv, current)
    assert w.tolist() == [0.0, 0.0, 1.0, 1.0]


# ---------------------------------------------------------------- combining


def test_ess_and_perplexity_ratio_are_recomputed_from_the_combined_means():
    def part(log_rho, rows):  # the mismatch metrics of tokens with these log-ratios, in `rows` rollouts
        n = len(log_rho)
        m = mismatch_metrics(torch.tensor(log_rho), torch.zeros(n), torch.arange(n) % rows, rows)
        return LazyMetrics.of(**m, num_tokens=(n, SUM), num_sequences=(rows, SUM))

    parts = [part([math.log(2.0)], 1), part([0.0, 0.0, 0.0], 2)]
    assert parts[0]["offpolicy_chi2_seq"] == pytest.approx(3.0) and parts[0]["offpolicy_ess"] == pytest.approx(1.0)
    out = combine_metrics(parts)  # tokens: rho = 2, 1, 1, 1
    assert out["offpolicy_ess"] == pytest.approx((5 / 4) ** 2 / (7 / 4))
    assert out["offpolicy_ppl_ratio"] == pytest.approx(2 ** -0.25)
    assert out["offpolicy_chi2_seq"] == pytest.approx(1.0)  # a sequence mean: (3 * 1 + 0 * 2) / 3
