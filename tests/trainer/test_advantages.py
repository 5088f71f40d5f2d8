"""Advantage estimators (GRPO's group-relative ones, PPO's GAE) and reward shaping against naive float64 loops."""

import math

import pytest
import torch

from SimpleTorchLLMRL.reward.length import overlong_penalty
from SimpleTorchLLMRL.trainer import grpo as A
from SimpleTorchLLMRL.trainer import pipeline
from SimpleTorchLLMRL.trainer.ppo import gae, terminal_token_rewards


def _naive_group_adv(r, g, scale, eps):
    out = []
    for i in range(len(r)):
        members = [r[j] for j in range(len(r)) if g[j] == g[i]]
        pool = members if len(members) > 1 else list(r)
        mean = sum(pool) / len(pool)
        std = math.sqrt(sum((x - mean) ** 2 for x in pool) / max(len(pool) - 1, 1))
        out.append((r[i] - mean) / (std + eps) if scale else r[i] - mean)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scale", [True, False])
def test_group_relative_matches_naive(scale):
    r = [1.0, 0.0, 0.5, 2.0, 2.0, -1.0, 3.0]
    g = [0, 0, 0, 1, 1, 1, 2]  # the last rollout is alone: batch-wide baseline
    out = A.group_relative_advantages(torch.tensor(r, dtype=torch.float64), torch.tensor(g), scale, eps=1e-4)
    torch.testing.assert_close(out, _naive_group_adv(r, g, scale, 1e-4))


def test_batch_scaling_and_invalid_scale():
    r = torch.tensor([1.0, 0.0, 4.0, 2.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 1, 1])
    out = A.group_relative_advantages(r, g, "batch", eps=0.0)
    expect = torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64) / r.std()
    torch.testing.assert_close(out, expect)
    with pytest.raises(ValueError, match="scale_rewards"):
        A.group_relative_advantages(r, g, "max")


def test_all_equal_group_gives_zero_advantage():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5])
    out = A.group_relative_advantages(r, torch.tensor([0, 0, 0, 1, 1, 1]))
    assert torch.all(out[:3] == 0) and torch.isfinite(out).all()
    assert torch.all(A.rloo_advantages(r, torch.tensor([0, 0, 0, 1, 1, 1]))[:3] == 0)


def test_rloo_matches_naive():
    r = [1.0, 0.0, 0.5, 2.0, 2.0, -1.0, 3.0]
    g = [0, 0, 0, 1, 1, 1, 2]
    out = A.rloo_advantages(torch.tensor(r, dtype=torch.float64), torch.tensor(g))
    expect = []
    for i in range(len(r)):
        others = [r[j] for j in range(len(r)) if g[j] == g[i] and j != i]
        expect.append(r[i] - sum(others) / len(others) if others else 0.0)
    torch.testing.assert_close(out, torch.tensor(expect, dtype=torch.float64))


def test_whiten_and_reinforce_pp():
    x = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, -7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    out = A.whiten(x, mask, eps=0.0)
    expect = torch.tensor([[-1.5, -0.5, 0], [0.5, 1.5, 0]], dtype=torch.float64) / vals.std()
    torch.testing.assert_close(out, expect)
    torch.testing.assert_close(A.whiten(x, mask, shift_mean=False, eps=0.0), (expect + 2.5) * mask)
    r = torch.tensor([1.0, 0.0, 4.0, 2.0], dtype=torch.float64)
    out = A.reinforce_pp_advantages(r, torch.tensor([0, 0, 1, 1]))
    c = torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64)
    torch.testing.assert_close(out, c / (c.std() + 1e-8))


def _naive_gae(rewards, values, mask, gamma, lam):
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        steps = [t for t in range(T) if mask[i, t]]
        last = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_v = float(values[i, steps[k + 1]]) if k + 1 < len(steps) else 0.0
            delta = float(rewards[i, t]) + gamma * next_v - float(values[i, t])
            last = delta + gamma * lam * last
            adv[i, t] = last
    return adv, (adv + values) * mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (1.0, 0.0)])
def test_gae_matches_naive_over_non_contiguous_mask(gamma, lam):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(3, 9, generator=g, dtype=torch.float64)
    values = torch.randn(3, 9, generator=g, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 1, 0, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    n_adv, n_ret = _naive_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, n_adv)
    torch.testing.assert_close(ret, n_ret)
    if gamma == lam == 1.0:  # Monte-Carlo: advantage = sum of future rewards - value
        fut = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1])
        torch.testing.assert_close(adv, (fut - values) * mask)
    with pytest.raises(ValueError, match="gamma"):
        gae(rewards, values, mask, gamma=1.5)


def test_terminal_token_rewards():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 0, 0]])
    out = terminal_token_rewards(torch.tensor([2.0, -1.0]), mask)
    expect = torch.zeros(2, 6)
    expect[0, 4], expect[1, 3] = 2.0, -1.0
    torch.testing.assert_close(out, expect)


def test_groups_helpers():
    assert pipeline.groups_from_size(6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="group_size"):
        pipeline.groups_from_size(5, 3)
    assert pipeline.groups_from_keys(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]
    assert pipeline.group_sizes(torch.tensor([0, 1, 0, 2])).tolist() == [2, 1, 2, 1]


def test_overlong_penalty_and_dynamic_sampling():
    pen = overlong_penalty(torch.tensor([10, 80, 90, 100, 120]), max_length=100, cache_length=20)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(torch.tensor([1]), max_length=10, cache_length=20)
    keep = A.nonconstant_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [False, False, True, True, False, False]


def test_rollout_groups_by_size_id_or_prompt_and_partial_ids_refused():
    """The one grouping rule GRPO and Distill share (`pipeline.rollout_groups`)."""
    from SimpleTorchLLMRL.chat.message import Rollout

    def r(q, **meta):
        return Rollout.from_chat([{"role": "user", "content": q}, {"role": "assistant", "content": "x"}], **meta)

    same_prompt = [r("a"), r("b"), r("a")]
    assert pipeline.rollout_groups(same_prompt).tolist() == [0, 1, 0]
    assert pipeline.rollout_groups(same_prompt[:2] + [r("c")], group_size=3).tolist() == [0, 0, 0]
    assert pipeline.rollout_groups([r("a", group_id=7), r("a", group_id=3)]).tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"group_id'\] is set on some rollouts but not on rollouts \[1\]"):
        pipeline.rollout_groups([r("a", group_id=7), r("a")])
