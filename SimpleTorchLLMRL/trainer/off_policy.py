"""Off-policy correction between the sampler and the trainer, and the diagnostics of their mismatch.

Legend: n trained tokens, B rollouts (rows). Everything here works on flat (n,) tensors of trained
tokens with `row` (n,) long naming the rollout of each token, so GRPO's (N,) tokens and PPO's (B, T)
batch (flattened at its trained positions) share it. Pure tensor math: no host sync.

The sampler (e.g. vLLM, or an older policy in an async loop) drew the tokens; its log-probs
`sampled` are recorded with them. The trainer's `trainer_old` are its own log-probs of the same
tokens before the update. With a correction on, the PPO ratio uses `trainer_old` (decoupled PPO:
the proximal policy is the trainer's) and the token ratio

    rho_t = pi_trainer(y_t) / pi_sampler(y_t) = exp(trainer_old_t - sampled_t)

reweights or masks each token's loss. Tokens whose sampler log-prob is unknown (NaN) count as
on-policy (rho = 1).

`OffPolicy(level, mode, low, high, kl_threshold)` is the one option set (GRPO's and PPO's
`off_policy=`; `tis_cap=c` is its old spelling of `OffPolicy.tis(c)`):

    level  "token"      rho_t                                 (per token)
           "sequence"   prod_t rho_t = exp(sum_t log rho_t)   (one per rollout, on all its tokens)
           "geometric"  exp(mean_t log rho_t)                 (one per rollout; the geometric mean)
           None         no ratio weight (e.g. only the DeepSeek-V3.2 mask)
    mode   "truncate"   w = clamp(rho, low, high)             (low None: min(rho, high))
           "mask"       w = rho if low <= rho <= high else 0  (keeps the importance weight)
           "reject"     w = 1 if low <= rho <= high else 0    (a 0/1 mask, no reweighting)

For "mask" / "reject", low None means 1 / high. kl_threshold = delta adds the DeepSeek-V3.2 mask:
a rollout whose advantage is negative and whose mean_t (log pi_sampler - log pi_theta) exceeds delta
gets weight 0 (pi_theta: the current policy, detached, as in the report). Masked tokens keep their
place in the aggregator's denominator (as TRL and the DeepSeek-V3.2 formula; verl's rejection
sampling removes them from its response mask instead).

Sources (formulas re-derived, no code copied): truncated IS (Yao et al., "Your efficient RL
framework secretly brings you off-policy RL training", 2025; verl `rollout_is`, TRL
`vllm_importance_sampling_mode="token_truncate" | "sequence_truncate"`); masked IS (TRL
"token_mask" / "sequence_mask"; IcePop, Ring-1T report: M(k) = k on [alpha, beta], else 0);
rejection at token / sequence / geometric level (verl `rollout_rs`, whose geometric acceptance set
is low <= exp(mean log rho) <= high); the DeepSeek-V3.2 report's "off-policy sequence masking".
Diagnostics follow verl's rollout-correction metrics (`mismatch_metrics`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LEVELS = ("token", "sequence", "geometric", None)
MODES = ("truncate", "mask", "reject")
SEQUENCE_LOG_CAP = 20.0  # |sum_t log rho| cap of the sequence chi-square metric (exp(40) stays finite)


@dataclass(frozen=True)
class OffPolicy:
    """How the loss corrects for tokens drawn by a sampler other than the trainer; see the module docstring.

    Presets: `OffPolicy.tis(2.0)` (token truncation, `tis_cap`'s meaning), `OffPolicy.icepop(0.5, 5.0)`,
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
        """Truncated importance sampling, min(rho_t, cap): what `tis_cap=cap` means."""
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


def as_off_policy(name: str, off_policy, tis_cap: float | None) -> OffPolicy | None:
    """The configured correction: an `OffPolicy`, a dict of its fields, or `tis_cap`'s old spelling."""
    if isinstance(off_policy, dict):
        off_policy = OffPolicy(**off_policy)
    if off_policy is not None and not isinstance(off_policy, OffPolicy):
        raise ValueError(f"{name} off_policy={off_policy!r} is invalid; expected None, an OffPolicy or a dict "
                         "of its fields")
    if tis_cap is not None:
        if off_policy is not None and off_policy != OffPolicy.tis(tis_cap):  # equal: a config built from tis_cap
            raise ValueError(f"{name}: give tis_cap= or off_policy=, not both (tis_cap=c is "
                             "off_policy=OffPolicy.tis(c))")
        off_policy = OffPolicy.tis(tis_cap)
    return off_policy


def _per_row(values: torch.Tensor, row: torch.Tensor, rows: int) -> torch.Tensor:
    """(B,) sums of the (n,) values of each row."""
    return torch.zeros(rows, dtype=values.dtype, device=values.device).index_add(0, row, values)


def token_log_rho(trainer_old: torch.Tensor, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log rho (n,), known (n,) bool): log pi_trainer - log pi_sampler, 0 where the sampler's is unknown."""
    known = ~torch.isnan(sampled)
    return torch.where(known, trainer_old.detach() - torch.where(known, sampled, 0.0), 0.0), known


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
            total = _per_row(log_rho, row, rows)  # (B,)
            if op.level == "geometric":
                total = total / _per_row(known.to(log_rho.dtype), row, rows).clamp(min=1)
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
        kl = _per_row(drift, row, rows) / _per_row(known.to(drift.dtype), row, rows).clamp(min=1)  # (B,)
        drop = (advantages < 0) & (kl.index_select(0, row) > op.kl_threshold)
        kept = kept & ~drop
        weight = torch.where(drop, 0.0, weight)
    row_masked = _per_row(kept.to(log_rho.dtype), row, rows) == 0  # (B,)
    return weight.detach(), {"clipped": clipped, "masked": ~kept, "row_masked": row_masked}


@torch.no_grad()
def mismatch_metrics(trainer_old: torch.Tensor, sampled: torch.Tensor, row: torch.Tensor, rows: int) -> dict:
    """KL(sampler || trainer) (k1, k3), chi-square (token, sequence), ESS and perplexity ratio: 0-dim tensors.

    Means over the (n,) trained tokens (unknown sampler log-probs count as rho = 1) or the B rows,
    in `combine_metrics`' form: token means, sequence means, and the derived `offpolicy_ess` /
    `offpolicy_ppl_ratio`, recomputed from the combined means (micro-batch invariant):

        kl_k1 = mean(-log rho)              (E_sampler[log pi_sampler - log pi_trainer])
        kl_k3 = mean(rho - 1 - log rho)     (>= 0, low variance)
        chi2_token = mean(rho^2) - 1        chi2_seq = mean_rows(prod_t rho_t ^ 2) - 1
        ess = mean(rho)^2 / mean(rho^2)     (normalized effective sample size, in (0, 1])
        ppl_ratio = exp(kl_k1)              (PPL_trainer / PPL_sampler)
    """
    log_rho, _ = token_log_rho(trainer_old.float(), sampled.float())
    rho = torch.exp(log_rho)
    seq = _per_row(log_rho, row, rows).clamp(-SEQUENCE_LOG_CAP, SEQUENCE_LOG_CAP)  # (B,)
    out = {"offpolicy_kl_k1": (-log_rho).mean(), "offpolicy_kl_k3": (rho - 1 - log_rho).mean(),
           "offpolicy_ratio_mean": rho.mean(), "offpolicy_chi2_token": (rho * rho - 1).mean(),
           "offpolicy_chi2_seq": (torch.exp(2 * seq) - 1).mean()}
    out.update(derived_mismatch(out))
    return out


@torch.no_grad()
def correction_metrics(weight: torch.Tensor, correction: dict) -> dict:
    """What `correction_weights` did, as 0-dim tensors: the fractions of tokens clipped and masked (token
    means), of rollouts with every token masked (a sequence mean), and `tis_weight_mean` (the applied
    weight's token mean; its historical name)."""
    return {"offpolicy_clipped_frac": correction["clipped"].float().mean(),
            "offpolicy_masked_frac": correction["masked"].float().mean(),
            "offpolicy_masked_seq_frac": correction["row_masked"].float().mean(),
            "tis_weight_mean": weight.float().mean()}


def derived_mismatch(m: dict) -> dict:
    """ESS and perplexity ratio from the (combined) means `mismatch_metrics` reports; {} when absent."""
    if "offpolicy_ratio_mean" not in m or "offpolicy_chi2_token" not in m or "offpolicy_kl_k1" not in m:
        return {}
    exp = torch.exp if isinstance(m["offpolicy_kl_k1"], torch.Tensor) else math.exp
    return {"offpolicy_ess": m["offpolicy_ratio_mean"] ** 2 / (m["offpolicy_chi2_token"] + 1),
            "offpolicy_ppl_ratio": exp(m["offpolicy_kl_k1"])}
