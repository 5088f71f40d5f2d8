"""Advantage estimators and reward shaping, tensors in, tensors out.

Legend: B batch (rollouts), T tokens, G group size. `group` (B,) long holds
each rollout's group index (0..num_groups-1). Per-token tensors are (B, T),
aligned with input_ids, with `mask` (B, T) 1 on the trained tokens.
"""

from __future__ import annotations

import torch

from SimpleTorchLLMRL.reward.length import overlong_penalty  # noqa: F401  DAPO's, its old import path here


def groups_from_size(batch_size: int, group_size: int) -> torch.Tensor:
    """Consecutive blocks of `group_size`: (B,) long."""
    if group_size < 1 or batch_size % group_size:
        raise ValueError(f"group_size={group_size} does not divide the batch of {batch_size} rollouts")
    return torch.arange(batch_size) // group_size


def groups_from_keys(keys: list) -> torch.Tensor:
    """Equal (hashable) keys form a group, numbered by first appearance: (B,) long."""
    index: dict = {}
    return torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.long)


def rollout_groups(rollouts, group_size: int | None = None) -> torch.Tensor:
    """(B,) long group index of rollouts: `group_size` blocks, else metadata["group_id"] (on all of them, or
    a ValueError naming those without it), else identical prompt messages (role, name, content)."""
    if group_size is not None:
        return groups_from_size(len(rollouts), group_size)
    ids = [r.metadata.get("group_id") for r in rollouts]
    if all(i is not None for i in ids):
        return groups_from_keys(ids)
    if any(i is not None for i in ids):
        missing = [k for k, i in enumerate(ids) if i is None]
        raise ValueError(f"metadata['group_id'] is set on some rollouts but not on rollouts {missing[:10]}")
    return groups_from_keys([tuple((m.role, m.name, m.content) for m in r.prompt_messages) for r in rollouts])


def group_sizes(group: torch.Tensor) -> torch.Tensor:
    """How many rollouts share each rollout's group, (B,)."""
    return torch.bincount(group)[group]


def _group_mean(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    n = torch.bincount(group).to(x.dtype)  # (num_groups,)
    sums = torch.zeros_like(n).index_add_(0, group, x)
    return (sums / n)[group]  # (B,)


def _group_std(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Unbiased per-group std, 0 for a group of one, (B,)."""
    n = torch.bincount(group).to(x.dtype)
    dev = (x - _group_mean(x, group)) ** 2
    ss = torch.zeros_like(n).index_add_(0, group, dev)
    return torch.sqrt(ss / (n - 1).clamp(min=1))[group]


def group_relative_advantages(rewards: torch.Tensor, group: torch.Tensor, scale: bool | str = True,
                              eps: float = 1e-4) -> torch.Tensor:
    """GRPO: (r - mean_group) / (std_group + eps), (B,).

    scale: True / "group" divides by the group's unbiased std, "batch" by the
    batch's, False / "none" not at all (Dr. GRPO). A group whose rewards are all
    equal gets advantage 0. Rollouts alone in their group use the batch-wide
    mean and std instead (so a batch of singletons still learns).
    """
    r = rewards.to(torch.float64)
    single = group_sizes(group) == 1  # (B,)
    mean = torch.where(single, r.mean(), _group_mean(r, group))
    centered = r - mean
    batch_std = r.std() if r.numel() > 1 else r.new_zeros(())
    if scale is True or scale == "group":
        std = torch.where(single, batch_std, _group_std(r, group))
    elif scale == "batch":
        std = batch_std.expand_as(r)
    elif scale is False or scale == "none":
        return centered.to(rewards.dtype)
    else:
        raise ValueError(f"scale_rewards must be True, False, 'group', 'batch' or 'none', got {scale!r}")
    return (centered / (std + eps)).to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i - mean of the OTHER rollouts of the group, (B,); 0 for a group of one."""
    r = rewards.to(torch.float64)
    n = group_sizes(group).to(r.dtype)
    sums = torch.zeros(int(group.max()) + 1, dtype=r.dtype).index_add_(0, group, r)[group]
    loo = (sums - r) / (n - 1).clamp(min=1)
    return torch.where(n > 1, r - loo, torch.zeros_like(r)).to(rewards.dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor | None = None, shift_mean: bool = True,
           eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the entries where mask is set (all by default); same shape as x.

    REINFORCE++ whitens advantages over the whole batch this way.
    """
    m = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    w, x64 = m.to(torch.float64), x.to(torch.float64)  # masked sums, no boolean index: nothing waits for the device
    n = w.sum()
    mean = (x64 * w).sum() / n.clamp(min=1)  # 0 when nothing is set
    var = ((x64 - mean) ** 2 * w).sum() / (n - 1).clamp(min=1)  # unbiased, as torch.std
    std = torch.where(n > 1, var.sqrt(), torch.zeros_like(var))
    out = (x64 - mean) / (std + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out.to(x.dtype), torch.zeros_like(x))


def reinforce_pp_advantages(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the batch, (B,)."""
    return whiten(group_relative_advantages(rewards, group, scale=False))


ADVANTAGE_ESTIMATORS = ("group", "rloo", "reinforce++")


def terminal_token_rewards(score: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each rollout's scalar score on its last trained token, (B, T)."""
    B, T = mask.shape
    last = (torch.arange(T, device=mask.device) * mask.bool()).argmax(-1)  # (B,)
    out = torch.zeros(B, T, dtype=score.dtype, device=mask.device)
    out[torch.arange(B, device=mask.device), last] = score.to(mask.device)
    return out * mask.to(out.dtype)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the trained tokens of each row.

    rewards, values, mask (B, T) -> (advantages, returns) (B, T), zero where mask is 0.
    Untrained tokens (prompt, tool output between turns) are not time steps:
    the recursion skips them, so the next state of a trained token is the
    next trained token; after the last one the episode ends (next value 0).
    """
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    B, T = rewards.shape
    m = mask.bool()
    adv = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(B)
    last_gae = rewards.new_zeros(B)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        g = delta + gamma * lam * last_gae
        adv[:, t] = torch.where(m[:, t], g, torch.zeros_like(g))
        last_gae = torch.where(m[:, t], g, last_gae)
        next_value = torch.where(m[:, t], values[:, t], next_value)
    returns = (adv + values) * m.to(values.dtype)
    return adv, returns


# ---------------------------------------------------------------- DAPO reward shaping


def nonconstant_groups(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: (B,) bool, True for rollouts whose group's rewards are not all equal."""
    r = rewards.to(torch.float64)
    ng = int(group.max()) + 1
    hi = torch.full((ng,), -torch.inf, dtype=r.dtype).scatter_reduce(0, group, r, "amax")
    lo = torch.full((ng,), torch.inf, dtype=r.dtype).scatter_reduce(0, group, r, "amin")
    return (hi > lo)[group]
