"""Off-policy correction between the sampler and the trainer: a detached weight on each token's loss.

Legend: n trained tokens, B rollouts; flat (n,) tensors with `row` (n,) naming each token's rollout.
Pure tensor math, no host sync. With a correction on, the ratio's old policy is the trainer's own
(decoupled PPO) and rho_t = pi_trainer(y_t) / pi_sampler(y_t) = exp(trainer_old_t - sampled_t)
(rho = 1 where the sampler's log-prob is unknown) reweights or masks each token:

    level  "token" rho_t | "sequence" prod_t rho_t | "geometric" exp(mean_t log rho_t) | None: no ratio
    mode   "truncate" clamp(rho, low, high) | "mask" rho on [low, high], else 0 | "reject" 1 there, else 0

(low None: 0 for "truncate", 1 / high otherwise). kl_threshold = delta: DeepSeek-V3.2's sequence mask.
Masked tokens keep their place in the aggregate's denominator. Sources: docs/losses.md, "Off-policy
correction"; the mismatch diagnostics are `losses.mismatch_metrics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from SimpleTorchLLMRL.trainer.losses import SEQUENCE_MEAN, TOKEN_MEAN, per_row, token_log_rho

LEVELS = ("token", "sequence", "geometric", None)
MODES = ("truncate", "mask", "reject")


@dataclass(frozen=True)
class OffPolicy:
    """How the loss corrects for tokens drawn by a sampler other than the trainer; see the module docstring.

    Presets: `OffPolicy.tis(2.0)` (token truncation), `OffPolicy.icepop(0.5, 5.0)`,
    `OffPolicy.geometric_mask(0.999, 1.001)`, `OffPolicy.deepseek(delta)`.
    """

    level: str | None = "token"
    mode: str = "truncate"
    low: float | None = None
    high: float | None = 2.0
    kl_threshold: float | None = None

    def __post_init__(self):
        def bad(what):
            raise ValueError(f"OffPolicy {what}")

        if self.level not in LEVELS:
            bad(f"level={self.level!r} is invalid; expected one of {LEVELS}")
        if self.mode not in MODES:
            bad(f"mode={self.mode!r} is invalid; expected one of {MODES}")
        if self.level is None and self.kl_threshold is None:
            bad("has nothing to correct: give a level or kl_threshold= (the mismatch metrics are logged "
                "whenever the rollouts carry sampler log-probs)")
        if self.level is not None and self.high is None:
            bad(f"level={self.level!r} needs high= (the upper bound of the ratio)")
        if self.high is not None and not self.high > 0:
            bad(f"high={self.high!r} is invalid; expected > 0")
        if self.low is not None and not self.low >= 0:
            bad(f"low={self.low!r} is invalid; expected >= 0")
        if self.low is not None and self.high is not None and not self.low < self.high:
            bad(f"low={self.low!r} must be below high={self.high!r}")
        if self.kl_threshold is not None and not self.kl_threshold >= 0:
            bad(f"kl_threshold={self.kl_threshold!r} is invalid; expected >= 0")

    @classmethod
    def tis(cls, cap: float) -> OffPolicy:
        """Truncated importance sampling, min(rho_t, cap)."""
        return cls("token", "truncate", None, cap)

    @classmethod
    def icepop(cls, low: float = 0.5, high: float = 5.0) -> OffPolicy:
        """IcePop (Ring-1T): keep rho_t as the token's weight on [low, high], 0 outside."""
        return cls("token", "mask", low, high)

    @classmethod
    def geometric_mask(cls, low: float = 0.999, high: float = 1.001) -> OffPolicy:
        """Drop whole rollouts whose exp(mean_t log rho_t) leaves [low, high] (verl's geometric rejection)."""
        return cls("geometric", "reject", low, high)

    @classmethod
    def deepseek(cls, kl_threshold: float) -> OffPolicy:
        """DeepSeek-V3.2: drop negative-advantage rollouts whose sampler-vs-current KL exceeds the threshold."""
        return cls(None, "reject", None, None, kl_threshold)

    @property
    def bounds(self) -> tuple[float, float]:
        """[low, high] of the ratio as log-bounds (the comparison happens in log space: no overflow)."""
        low = self.low
        if low is None:
            low = 0.0 if self.mode == "truncate" else 1.0 / self.high
        return (math.log(low) if low > 0 else -math.inf), math.log(self.high)

    @property
    def needs_whole_sequences(self) -> bool:
        """Whether a token's weight depends on the other tokens of its rollout (no chunk-by-chunk loss)."""
        return self.level in ("sequence", "geometric") or self.kl_threshold is not None


def as_off_policy(name: str, off_policy) -> OffPolicy | None:
    """The configured correction: None, an `OffPolicy` or a dict of its fields."""
    if isinstance(off_policy, dict):
        off_policy = OffPolicy(**off_policy)
    if off_policy is not None and not isinstance(off_policy, OffPolicy):
        raise ValueError(f"{name} off_policy={off_policy!r} is invalid; expected None, an OffPolicy or a dict "
                         "of its fields")
    return off_policy


def correction_weights(op: OffPolicy, trainer_old: torch.Tensor, sampled: torch.Tensor, row: torch.Tensor,
                       rows: int, advantages: torch.Tensor, current: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The per-token weight (n,) that multiplies each token's loss, detached, and what it did.

    trainer_old, sampled (NaN: unknown), advantages, current (the policy's log-probs now): (n,).
    Returns (weight, stats) with stats' (n,) bool "clipped" (a truncated ratio) and "masked"
    (weight 0 by the mask / rejection / DeepSeek rule), and (B,) bool "row_masked" (every token 0).
    """
    log_rho, known = token_log_rho(trainer_old, sampled)
    weight = torch.ones_like(log_rho)
    clipped = torch.zeros_like(known)
    kept = torch.ones_like(known)
    if op.level is not None:
        if op.level == "token":
            stat = log_rho
        else:
            total = per_row(log_rho, row, rows)  # (B,)
            if op.level == "geometric":
                total = total / per_row(known.to(log_rho.dtype), row, rows).clamp(min=1)
            stat = total.index_select(0, row)  # (n,)
        lo, hi = op.bounds
        inside = (stat >= lo) & (stat <= hi)
        if op.mode == "truncate":
            weight = torch.exp(stat.clamp(min=lo, max=hi))
            clipped = ~inside
        else:
            kept = inside
            weight = inside.to(log_rho.dtype) if op.mode == "reject" else \
                torch.exp(torch.where(inside, stat, 0.0)) * inside.to(log_rho.dtype)
    if op.kl_threshold is not None:  # DeepSeek-V3.2: mean_t log(pi_sampler / pi_theta) per rollout
        drift = torch.where(known, torch.where(known, sampled, 0.0) - current.detach(), 0.0)
        kl = per_row(drift, row, rows) / per_row(known.to(drift.dtype), row, rows).clamp(min=1)  # (B,)
        drop = (advantages < 0) & (kl.index_select(0, row) > op.kl_threshold)
        kept = kept & ~drop
        weight = torch.where(drop, 0.0, weight)
    row_masked = per_row(kept.to(log_rho.dtype), row, rows) == 0  # (B,)
    return weight.detach(), {"clipped": clipped, "masked": ~kept, "row_masked": row_masked}


@torch.no_grad()
def correction_metrics(weight: torch.Tensor, correction: dict) -> dict:
    """What `correction_weights` did, as 0-dim tensors with their reductions: the fractions of tokens clipped and masked (token
    means), of rollouts with every token masked (a sequence mean), and `tis_weight_mean` (the applied
    weight's token mean; its historical name)."""
    return {"offpolicy_clipped_frac": (correction["clipped"].float().mean(), TOKEN_MEAN),
            "offpolicy_masked_frac": (correction["masked"].float().mean(), TOKEN_MEAN),
            "offpolicy_masked_seq_frac": (correction["row_masked"].float().mean(), SEQUENCE_MEAN),
            "tis_weight_mean": (weight.float().mean(), TOKEN_MEAN)}
