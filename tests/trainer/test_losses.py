"""Pure loss functions against naive float64 formulas: values and gradients."""

import math

import pytest
import torch

from SimpleTorchLLMRL.trainer import losses as L
from SimpleTorchLLMRL.trainer.grpo import LOSS_TYPES, GRPOConfig, cispo_loss, sequence_log_ratio
from SimpleTorchLLMRL.trainer.off_policy import OffPolicy, correction_weights
from SimpleTorchLLMRL.trainer.ppo import value_loss


def _data(B=4, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios well outside [0.8, 1.2]
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)  # per token: both signs in every test
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 0
    mask[:, 1] = 1
    return logp.requires_grad_(), old, adv, mask


def _naive_clip(logp, old, adv, lo, hi, dual=None):
    B, T = logp.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            r = math.exp(logp[i, t] - old[i, t])
            a = float(adv[i, t])
            val = -min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
            if dual is not None and a < 0:
                val = min(val, -dual * a)
            out[i, t] = val
    return out


@pytest.mark.parametrize("lo,hi,dual", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_clipped_surrogate_values_and_grad(lo, hi, dual):
    logp, old, adv, mask = _data()
    loss, stats = L.clipped_surrogate(logp - old, logp, adv, L.Clip(lo, hi, dual))
    torch.testing.assert_close(loss.detach(), _naive_clip(logp.detach(), old, adv, lo, hi, dual))
    loss.sum().backward()
    # d/dlogp of -r A is -r A where the unclipped branch is active, 0 where the clip (or dual clip) binds
    r = torch.exp(logp.detach() - old)
    active = ~(stats["clipped_low"] | stats["clipped_high"])
    if dual is not None:
        active &= ~((adv < 0) & (-r * adv > -dual * adv))
    torch.testing.assert_close(logp.grad, torch.where(active, -r * adv, torch.zeros_like(r)))
    assert stats["clipped_low"].any() and stats["clipped_high"].any()


def test_cispo_weight_is_clipped_and_detached():
    logp, old, adv, mask = _data(seed=1)
    hi = 0.25
    loss, stats = cispo_loss(logp - old, logp, adv, L.Clip(0.2, hi))
    w = torch.clamp(torch.exp(logp.detach() - old), max=1 + hi)
    torch.testing.assert_close(loss.detach(), -w * adv * logp.detach())
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, (-w * adv).expand_as(w))  # every token keeps a gradient
    assert torch.equal(stats["clipped_high"], torch.exp(logp.detach() - old) > 1 + hi)


def test_sequence_log_ratio_is_length_normalized():
    logp, old, _, mask = _data(seed=2)
    select = mask.bool()
    row = torch.arange(logp.shape[0])[:, None].expand_as(mask)[select]  # (N,) the rollout of each trained token
    s = sequence_log_ratio((logp - old)[select], row, logp.shape[0])  # (N,)
    for i in range(logp.shape[0]):
        m = mask[i].bool()
        expect = float((logp.detach()[i][m] - old[i][m]).sum()) / int(m.sum())
        assert torch.allclose(s[row == i].detach(), torch.full_like(s[row == i], expect))
    first = torch.stack([(row == i).nonzero()[0, 0] for i in range(logp.shape[0])])
    s[first].sum().backward()  # one entry per rollout
    torch.testing.assert_close(logp.grad, mask.double() / mask.sum(-1, keepdim=True))


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_kl_estimators(name):
    logp, old, _, _ = _data(seed=3)
    ref = old
    naive = {
        "k1": lambda lp: lp - ref,
        "k2": lambda lp: 0.5 * (lp - ref) ** 2,
        "k3": lambda lp: (ref - lp).exp() - (ref - lp) - 1,
    }[name]
    est = L.KL_ESTIMATORS[name](logp, ref)
    torch.testing.assert_close(est, naive(logp))
    est.sum().backward()
    lp2 = logp.detach().clone().requires_grad_()
    naive(lp2).sum().backward()
    torch.testing.assert_close(logp.grad, lp2.grad)
    if name in ("k2", "k3"):
        assert (est >= 0).all()


def test_kl_estimators_are_unbiased_for_kl():
    """Sample from p, compare E[k1], E[k3] with the exact KL(p || q) on a small categorical."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(6, dtype=torch.float64), 0)
    exact = float((p * (p.log() - q.log())).sum())
    x = torch.multinomial(p, 200_000, replacement=True)
    lp, lq = p.log()[x], q.log()[x]
    assert abs(float(L.kl_k1(lp, lq).mean()) - exact) < 0.02
    assert abs(float(L.kl_k3(lp, lq).mean()) - exact) < 0.02


def test_truncated_is_weight():
    trainer = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    sampler = torch.tensor([-1.5, -1.0, float("nan"), -6.0])
    row, adv = torch.zeros(4, dtype=torch.long), torch.ones(4)
    w, _ = correction_weights(OffPolicy.tis(2.0), trainer, sampler, row, 1, adv, trainer)
    expect = torch.tensor([math.exp(0.5), math.exp(-1.0), 1.0, 2.0])
    torch.testing.assert_close(w, expect)
    with pytest.raises(ValueError, match="high"):
        OffPolicy.tis(0)


def _aggregate(aggregate, x, mask, normalizer=None, max_tokens=None):
    """The aggregate of (B, T) per-token values x through the flat per-token weights of the loss units."""
    inputs = L.LossInputs.from_tokens(mask, normalizer, logprobs=x)
    return (inputs.logprobs * L.weights(aggregate, inputs, max_tokens).double()).sum()


def test_aggregators_match_naive():
    x, _, _, mask = _data(seed=4)
    x = x.detach()
    m = mask.double()
    torch.testing.assert_close(_aggregate("token_mean", x, mask), (x * m).sum() / m.sum())
    per_row = torch.stack([(x[i] * m[i]).sum() / m[i].sum() for i in range(x.shape[0])])
    torch.testing.assert_close(_aggregate("sequence_mean_token_mean", x, mask), per_row.mean())
    torch.testing.assert_close(_aggregate("token_sum_constant", x, mask, 100.0), (x * m).sum() / 100.0)
    longest = float(m.sum(-1).max())  # without a normalizer: rows x the longest row (max_tokens: that instead)
    torch.testing.assert_close(_aggregate("token_sum_constant", x, mask), (x * m).sum() / (x.shape[0] * longest))
    torch.testing.assert_close(_aggregate("token_sum_constant", x, mask, max_tokens=9), (x * m).sum() / (4 * 9))
    x_nan = x.clone()
    x_nan[mask == 0] = float("nan")  # untrained positions never leak into the loss
    assert torch.isfinite(_aggregate("token_mean", x_nan, mask))


@pytest.mark.parametrize("aggregate", L.AGGREGATES)
def test_micro_batch_accumulation_equals_full_batch(aggregate):
    x, _, _, mask = _data(B=6, seed=5)
    norm = L.normalizer(aggregate, mask, max_tokens=5)
    full = _aggregate(aggregate, x, mask, norm)
    full.backward()
    g_full = x.grad.clone()
    x.grad = None
    parts = sum(_aggregate(aggregate, x[s:s + 2], mask[s:s + 2], norm) for s in range(0, 6, 2))
    parts.backward()
    torch.testing.assert_close(parts, full)
    torch.testing.assert_close(x.grad, g_full)
    assert torch.all(x.grad[mask == 0] == 0)  # zero gradient on untrained tokens


def test_value_loss_matches_naive():
    g = torch.Generator().manual_seed(6)
    v = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    v_old = v.detach() + 0.5 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    ret = torch.randn(3, 5, generator=g, dtype=torch.float64)
    out = value_loss(v, v_old, ret, 0.2)
    v_clip = v_old + (v.detach() - v_old).clamp(-0.2, 0.2)
    naive = 0.5 * torch.maximum((v.detach() - ret) ** 2, (v_clip - ret) ** 2)
    torch.testing.assert_close(out.detach(), naive)
    torch.testing.assert_close(value_loss(v, v_old, ret, None).detach(), 0.5 * (v.detach() - ret) ** 2)


def test_clip_and_names_validation():
    with pytest.raises(ValueError, match="eps"):
        L.Clip(1.2, 0.2)
    with pytest.raises(ValueError, match="eps_high"):
        L.Clip(0.2, -0.1)
    with pytest.raises(ValueError, match="dual_clip"):
        L.Clip(0.2, 0.2, 0.5)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        GRPOConfig(importance_sampling_level="chunk")
    with pytest.raises(ValueError, match="aggregate"):
        L.normalizer("median", torch.ones(1, 2))
    assert set(LOSS_TYPES) == {"grpo", "bnpo", "dapo", "dr_grpo", "gspo", "cispo"}
