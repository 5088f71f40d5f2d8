"""`CombinedReward`: a weighted sum of rewards that also reports each component.

Legend: B batch.

    reward = CombinedReward([(BoxedReward(), 1.0), (FormatReward.from_tags(["think"]), 0.1)])
    total = reward(rollouts, answers)            # (B,) float32 = 1.0 * boxed + 0.1 * format
    total, parts = reward.compute(rollouts, answers)   # parts: {"boxed": (B,), "format": (B,)}, unweighted

Names come from `names=`, else `.name` / `__name__`, made unique ("boxed", "boxed_1"); summed in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.reward.base import check_batch

RewardFn = Callable[[Sequence[Rollout], Sequence[Any] | None], torch.Tensor]


class CombinedReward:
    """sum_i weight_i * reward_i(rollouts, ground_truths); components kept in `last_components`."""

    name = "combined"

    def __init__(self, rewards: Sequence[tuple[RewardFn, float]], names: Sequence[str] | None = None):
        rewards = list(rewards)
        if not rewards:
            raise ValueError("rewards must be a non-empty list of (reward, weight) pairs")
        for i, pair in enumerate(rewards):
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ValueError(f"rewards[{i}] must be a (reward, weight) pair, got {pair!r}")
            fn, w = pair
            if not callable(fn):
                raise ValueError(f"rewards[{i}][0] must be callable as fn(rollouts, ground_truths), got {fn!r}")
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                raise ValueError(f"rewards[{i}] weight must be a finite number, got {w!r}")
        if names is not None:
            names = list(names)
            if len(names) != len(rewards) or len(set(names)) != len(names):
                raise ValueError(f"names must be {len(rewards)} distinct strings, got {names!r}")
        else:
            names, seen = [], {}
            for fn, _ in rewards:
                base = str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__)
                k = seen.get(base, 0)
                seen[base] = k + 1
                names.append(base if k == 0 else f"{base}_{k}")
        self.rewards = [fn for fn, _ in rewards]
        self.weights = [float(w) for _, w in rewards]
        self.names = names
        self.last_components: dict[str, torch.Tensor] = {}

    def compute(self, rollouts: Sequence[Rollout], ground_truths: Sequence[Any] | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(total (B,) float32, {name: unweighted component (B,) float32})."""
        check_batch(rollouts, ground_truths)
        B = len(rollouts)
        total = torch.zeros(B, dtype=torch.float64)  # (B,)
        parts: dict[str, torch.Tensor] = {}
        for name, fn, w in zip(self.names, self.rewards, self.weights, strict=True):
            r = torch.as_tensor(fn(rollouts, ground_truths)).detach().cpu()
            if r.shape != (B,):
                raise ValueError(f"reward {name!r} returned shape {tuple(r.shape)}, expected ({B},)")
            parts[name] = r.to(torch.float32)
            total += w * r.to(torch.float64)
        self.last_components = parts
        return total.to(torch.float32), parts

    def __call__(self, rollouts: Sequence[Rollout], ground_truths: Sequence[Any] | None = None) -> torch.Tensor:
        return self.compute(rollouts, ground_truths)[0]

    def metrics(self) -> dict[str, float]:
        """Mean of each component of the last call, e.g. for a logger: {"reward/boxed": 0.5, ...}."""
        return {f"reward/{k}": float(v.mean()) for k, v in self.last_components.items()}

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}*{w:g}" for n, w in zip(self.names, self.weights, strict=True))
        return f"CombinedReward({inner})"
