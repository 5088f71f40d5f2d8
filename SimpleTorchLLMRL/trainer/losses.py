"""The pieces every loss unit shares: `LossOutput`, ratios, what "old" means, KL estimators, surrogates,
aggregators.

Legend: B batch, T tokens. Every per-token tensor is (B, T) and aligned with
input_ids; `mask` (B, T) is 1 on the tokens that are trained. Per-token losses
are returned unaggregated; an aggregator turns them into a scalar with a
caller-supplied `normalizer`, so summing micro-batch losses that share the
full batch's normalizer equals the full-batch loss.

The GRPO family is a table of compositions (`LOSS_TYPES`): a per-token
policy loss, the ratio level and an aggregator. The loss units themselves are one file per
family: `grpo_loss`, `ppo_loss`, `distill_loss`, `sft`, `dpo` (docs/losses.md lists them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

# ---------------------------------------------------------------- what a loss unit returns


class LossOutput(NamedTuple):
    """What every loss unit (and every front's `compute`) returns.

    loss: the scalar loss with grad, a share of the full batch's when a normalizer was passed.
    metrics: a dict of 0-dim tensors (a `combine.LazyMetrics` from the GRPO family, PPO and the
    fronts), in `combine_metrics`' form: nothing waits for the device until a value is read.
    token_logprobs: the trained tokens' log-probs, detached, shaped as the unit's input: (N,)
    for `grpo_loss` (hidden states of the N trained tokens), (B, T) for the units on (B, T)
    tensors and for the fronts' `compute` (NaN where not trained there).
    """

    loss: torch.Tensor
    metrics: dict
    token_logprobs: torch.Tensor

    @property
    def logprobs(self) -> torch.Tensor:
        """The old name of `token_logprobs`."""
        return self.token_logprobs


# ---------------------------------------------------------------- importance ratios


def token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """log pi / pi_old per token, any shape."""
    return logp - old_logp


def sequence_log_ratio(log_ratio: torch.Tensor, row: torch.Tensor, rows: int) -> torch.Tensor:
    """GSPO: each rollout's length-normalized log-ratio, mean_t (log pi - log pi_old), on each of its tokens.

    log_ratio (n,) per trained token, row (n,) long its rollout, rows B -> (n,). The gradient
    of token t's entry flows to every token of its rollout, 1 / |rollout| each.
    """
    count = torch.zeros(rows, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(
        0, row, torch.ones_like(log_ratio))  # (B,)
    total = torch.zeros(rows, dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, row, log_ratio)
    return (total / count.clamp(min=1)).index_select(0, row)


def old_and_tis(trainer_old: torch.Tensor, sampled: torch.Tensor | None, mask: torch.Tensor | None,
                tis_cap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Old log-probs for the ratio, and the TIS weight (None without tis_cap), both shaped as `trainer_old`.

    The one place GRPO and PPO decide what "old" means. trainer_old: the trainer's own old
    log-probs (`old_logprobs`); sampled: the generator's (`sampler_logprobs`, NaN where unknown).
    Without TIS the sampler's log-probs are the old policy where known (the trainer's
    elsewhere). With TIS the ratio uses the trainer's and min(pi_trainer / pi_sampler, cap)
    reweights each token. Positions outside `mask` (None: every position is trained) get finite
    values so nothing NaN reaches the graph. Works on (B, T) and on (N,) trained tokens alike.
    """
    m = torch.ones_like(trainer_old, dtype=torch.bool) if mask is None else mask.bool()
    if sampled is None:
        return torch.where(m, trainer_old, 0.0), None
    known = m & ~torch.isnan(sampled)
    if tis_cap is None:
        return torch.where(known, sampled, torch.where(m, trainer_old, 0.0)), None
    weight = truncated_is_weight(trainer_old, torch.where(known, sampled, torch.nan), tis_cap)
    return torch.where(m, trainer_old, 0.0), weight


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


class Aggregator:
    """One way to turn per-token losses (B, T) into a scalar; owns its weights and its normaliser.

    `normalizer(mask)` is the FULL batch's denominator (pass it to every micro-batch: their
    losses then add up to the full batch's); `weights(mask, normalizer)` (B, T) are the
    per-token weights with `self(x, mask, normalizer) == (x * weights).sum()`, 0 off the mask.
    A normalizer of None means this batch's own (`normalizer(mask)`).
    """

    name: str

    def normalizer(self, mask: torch.Tensor, max_tokens: int | None = None) -> float:
        raise NotImplementedError

    def _weights(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        """(the weights before dividing by the normaliser (B, T), this batch's own normaliser)."""
        raise NotImplementedError

    def weights(self, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
        m, own = self._weights(mask.to(torch.float32))
        return m / max(float(own if normalizer is None else normalizer), 1.0)

    def __call__(self, x: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
        m, own = self._weights(mask.to(x.dtype))
        return (x * m).sum() / max(float(own if normalizer is None else normalizer), 1.0)

    def __repr__(self) -> str:
        return f"Aggregator({self.name!r})"


class TokenMean(Aggregator):
    """sum over trained tokens / their count (DAPO, BNPO, CISPO, PPO). Normaliser: the trained tokens."""

    name = "token_mean"

    def normalizer(self, mask, max_tokens=None):
        return float(mask.sum())

    def _weights(self, m):
        return m, m.sum()


class SequenceMeanTokenMean(Aggregator):
    """mean over rows of (mean over the row's trained tokens) (GRPO, GSPO). Normaliser: the rows."""

    name = "sequence_mean_token_mean"

    def normalizer(self, mask, max_tokens=None):
        return float(mask.shape[0])

    def _weights(self, m):
        return m / m.sum(-1, keepdim=True).clamp(min=1), m.shape[0]


class TokenSumConstant(Aggregator):
    """sum over trained tokens / a constant (Dr. GRPO). Normaliser: rows x max_tokens (None: the longest row);
    without a normaliser, B x T."""

    name = "token_sum_constant"

    def normalizer(self, mask, max_tokens=None):
        per_row = max_tokens if max_tokens is not None else int(mask.sum(-1).max())
        return float(mask.shape[0] * per_row)

    def _weights(self, m):
        return m, m.shape[0] * m.shape[1]


AGGREGATORS: dict[str, Aggregator] = {a.name: a for a in (TokenMean(), SequenceMeanTokenMean(), TokenSumConstant())}
token_mean = AGGREGATORS["token_mean"]  # token_mean(x, mask, normalizer): PPO's and the docs' spelling


def aggregator(name: str) -> Aggregator:
    """The `Aggregator` called `name`; ValueError naming the allowed ones."""
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregate {name!r}; expected one of {sorted(AGGREGATORS)}")
    return AGGREGATORS[name]


def aggregation_weights(aggregate: str, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """Per-token weights w (B, T) with AGGREGATORS[aggregate](x, mask, normalizer) == (x * w).sum()."""
    return aggregator(aggregate).weights(mask, normalizer)


def default_normalizer(aggregate: str, mask: torch.Tensor, max_tokens: int | None = None) -> float:
    """The full batch's denominator for `aggregate` (pass it to every micro-batch)."""
    return aggregator(aggregate).normalizer(mask, max_tokens)


# ---------------------------------------------------------------- the GRPO family


@dataclass(frozen=True)
class LossSpec:
    """A GRPO-family variant: which per-token loss, which ratio, which aggregator."""

    policy_loss: Callable
    aggregate: str
    ratio_level: str | None = None  # forces "token" / "sequence"; None: the trainer's option
    default_eps_high: float | None = None  # used when eps_high is not given

    @property
    def aggregator(self) -> Aggregator:
        return AGGREGATORS[self.aggregate]


LOSS_TYPES: dict[str, LossSpec] = {
    "grpo": LossSpec(clipped_surrogate, "sequence_mean_token_mean"),
    "bnpo": LossSpec(clipped_surrogate, "token_mean"),
    "dapo": LossSpec(clipped_surrogate, "token_mean", default_eps_high=0.28),
    "dr_grpo": LossSpec(clipped_surrogate, "token_sum_constant"),
    "gspo": LossSpec(clipped_surrogate, "sequence_mean_token_mean", ratio_level="sequence"),
    "cispo": LossSpec(cispo_loss, "token_mean"),
}

RATIO_LEVELS = ("token", "sequence")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip_range: float | None) -> torch.Tensor:
    """PPO's clipped value loss per token, (B, T): 0.5 max((v-R)^2, (v_old + clip(v-v_old) - R)^2)."""
    unclipped = (values - returns) ** 2
    if clip_range is None:
        return 0.5 * unclipped
    v_clip = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    return 0.5 * torch.maximum(unclipped, (v_clip - returns) ** 2)
