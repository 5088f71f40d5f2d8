"""Pure policy-gradient loss pieces: ratios, KL estimators, surrogates, aggregation.

Legend: B batch, T tokens. Every per-token tensor is (B, T) and aligned with
input_ids; `mask` (B, T) is 1 on the tokens that are trained. Per-token losses
are returned unaggregated; an aggregator turns them into a scalar with a
caller-supplied `normalizer`, so summing micro-batch losses that share the
full batch's normalizer equals the full-batch loss.

The GRPO family is a table of compositions (`LOSS_TYPES`): a per-token
policy loss, the ratio level and an aggregator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# ---------------------------------------------------------------- importance ratios


def token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """log pi / pi_old per token, (B, T)."""
    return logp - old_logp


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: the length-normalized sequence log-ratio, broadcast to every token, (B, T).

    s_i = exp(mean_t (log pi - log pi_old) over the trained tokens of row i).
    """
    m = mask.to(logp.dtype)
    per_seq = ((logp - old_logp) * m).sum(-1) / m.sum(-1).clamp(min=1)  # (B,)
    return per_seq[:, None].expand_as(logp)


# ---------------------------------------------------------------- KL estimators (samples from pi)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log ref (unbiased, high variance), (B, T)."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log ref)^2 / 2, (B, T)."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = ref/pi - log(ref/pi) - 1 >= 0 (unbiased, low variance; GRPO's choice), (B, T)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1, "k2": kl_k2, "k3": kl_k3,
}

# ---------------------------------------------------------------- per-token policy losses


@dataclass(frozen=True)
class Clip:
    """Ratio clip range [1 - low, 1 + high]; `dual` (> 1) caps the loss of negative advantages."""

    low: float = 0.2
    high: float = 0.2
    dual: float | None = None

    def __post_init__(self):
        if not (0 <= self.low < 1):
            raise ValueError(f"clip low (eps) must be in [0, 1), got {self.low}")
        if self.high < 0:
            raise ValueError(f"clip high (eps_high) must be >= 0, got {self.high}")
        if self.dual is not None and self.dual <= 1:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual}")


def clipped_surrogate(log_ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, clip: Clip):
    """PPO-clip: -min(r A, clip(r, 1-low, 1+high) A), optional dual clip, (B, T).

    adv (B, T) or (B, 1). Returns (loss, clipped) where clipped (B, T) bool marks
    tokens whose gradient the clip removed (low side: r < 1-low, A < 0; high side: r > 1+high, A > 0).
    """
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped_obj = torch.clamp(ratio, 1 - clip.low, 1 + clip.high) * adv
    loss = -torch.minimum(unclipped, clipped_obj)
    if clip.dual is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -clip.dual * adv), loss)
    low = (ratio < 1 - clip.low) & (adv < 0)
    high = (ratio > 1 + clip.high) & (adv > 0)
    return loss, {"clipped_low": low, "clipped_high": high}


def cispo_loss(log_ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, clip: Clip):
    """CISPO (MiniMax-M1): -sg(min(r, 1+high)) A log pi, (B, T).

    The importance weight is clipped from above only and detached; every token
    keeps a gradient through log pi (nothing is dropped, unlike PPO-clip).
    """
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=1 + clip.high).detach()
    loss = -weight * adv * logp
    return loss, {"clipped_low": torch.zeros_like(ratio, dtype=torch.bool), "clipped_high": ratio > 1 + clip.high}


def truncated_is_weight(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """TIS: min(pi_trainer / pi_sampler, cap), detached, (B, T); 1 where sampler_logp is NaN.

    Corrects for the generator (e.g. vLLM) and the trainer computing slightly
    different probabilities for the same policy; multiply the per-token loss by it.
    """
    if cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {cap}")
    known = ~torch.isnan(sampler_logp)
    w = torch.exp(trainer_logp.detach() - torch.where(known, sampler_logp, trainer_logp.detach()))
    return torch.where(known, w.clamp(max=cap), torch.ones_like(w))


# ---------------------------------------------------------------- aggregation


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask.to(x.dtype)).sum()


def token_mean(x: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """sum over trained tokens / normalizer (default: their count). DAPO / BNPO / CISPO."""
    n = mask.sum() if normalizer is None else normalizer
    return masked_sum(x, mask) / max(float(n), 1.0)


def sequence_mean_token_mean(x: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """mean over rows of (mean over the row's trained tokens); normalizer = number of rows. GRPO / GSPO."""
    m = mask.to(x.dtype)
    per_row = (x * m).sum(-1) / m.sum(-1).clamp(min=1)  # (B,)
    n = x.shape[0] if normalizer is None else normalizer
    return per_row.sum() / max(float(n), 1.0)


def token_sum_constant(x: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """sum over trained tokens / a constant (Dr. GRPO: rows x max tokens). Default constant: B x T."""
    n = x.shape[0] * x.shape[1] if normalizer is None else normalizer
    return masked_sum(x, mask) / max(float(n), 1.0)


AGGREGATORS: dict[str, Callable[..., torch.Tensor]] = {
    "token_mean": token_mean,
    "sequence_mean_token_mean": sequence_mean_token_mean,
    "token_sum_constant": token_sum_constant,
}


def aggregation_weights(aggregate: str, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """Per-token weights w (B, T) with AGGREGATORS[aggregate](x, mask, normalizer) == (x * w).sum()."""
    m = mask.to(torch.float32)
    if aggregate == "token_mean":
        n = m.sum() if normalizer is None else normalizer
    elif aggregate == "sequence_mean_token_mean":
        m = m / m.sum(-1, keepdim=True).clamp(min=1)
        n = m.shape[0] if normalizer is None else normalizer
    elif aggregate == "token_sum_constant":
        n = m.shape[0] * m.shape[1] if normalizer is None else normalizer
    else:
        raise ValueError(f"unknown aggregate {aggregate!r}; expected one of {sorted(AGGREGATORS)}")
    return m / max(float(n), 1.0)


def default_normalizer(aggregate: str, mask: torch.Tensor, max_tokens: int | None = None) -> float:
    """The full batch's denominator for `aggregate` (pass it to every micro-batch)."""
    if aggregate == "token_mean":
        return float(mask.sum())
    if aggregate == "sequence_mean_token_mean":
        return float(mask.shape[0])
    if aggregate == "token_sum_constant":
        per_row = max_tokens if max_tokens is not None else int(mask.sum(-1).max())
        return float(mask.shape[0] * per_row)
    raise ValueError(f"unknown aggregate {aggregate!r}; expected one of {sorted(AGGREGATORS)}")


# ---------------------------------------------------------------- the GRPO family


@dataclass(frozen=True)
class LossSpec:
    """A GRPO-family variant: which per-token loss, which ratio, which aggregator."""

    policy_loss: Callable
    aggregate: str
    ratio_level: str | None = None  # forces "token" / "sequence"; None: the trainer's option
    default_eps_high: float | None = None  # used when eps_high is not given


LOSS_TYPES: dict[str, LossSpec] = {
    "grpo": LossSpec(clipped_surrogate, "sequence_mean_token_mean"),
    "bnpo": LossSpec(clipped_surrogate, "token_mean"),
    "dapo": LossSpec(clipped_surrogate, "token_mean", default_eps_high=0.28),
    "dr_grpo": LossSpec(clipped_surrogate, "token_sum_constant"),
    "gspo": LossSpec(clipped_surrogate, "sequence_mean_token_mean", ratio_level="sequence"),
    "cispo": LossSpec(cispo_loss, "token_mean"),
}

RATIO_LEVELS = ("token", "sequence")


def log_ratio_at(level: str, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if level == "token":
        return token_log_ratio(logp, old_logp)
    if level == "sequence":
        return sequence_log_ratio(logp, old_logp, mask)
    raise ValueError(f"importance_sampling_level must be one of {RATIO_LEVELS}, got {level!r}")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip_range: float | None) -> torch.Tensor:
    """PPO's clipped value loss per token, (B, T): 0.5 max((v-R)^2, (v_old + clip(v-v_old) - R)^2)."""
    unclipped = (values - returns) ** 2
    if clip_range is None:
        return 0.5 * unclipped
    v_clip = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    return 0.5 * torch.maximum(unclipped, (v_clip - returns) ** 2)
