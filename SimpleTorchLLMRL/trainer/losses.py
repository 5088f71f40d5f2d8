"""The contract of every loss unit, `fn(inputs: LossInputs, config) -> LossOutput`, and what units share.

Legend: N trained tokens of the batch (row-major: row 0's first, ...), n of a chunk, B sequences (rows).

A loss unit is one pure function and one config dataclass: it reads the N trained tokens' tensors
from `LossInputs` (named by where they come from) and returns the scalar loss, its metrics (0-dim
tensors, each with how it combines over micro-batches: `Reduce`) and the tokens' log-probs. A new
loss touches no file here. Shared: what "old" means (`old_logprobs`, decided once), the aggregates
(per-token weights from the FULL batch's normalizer, so micro-batch losses add up), KL estimators,
the PPO clip and the sampler-vs-trainer mismatch metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

import torch

# ---------------------------------------------------------------- inputs and output


@dataclass(frozen=True)
class LossInputs:
    """Per-token inputs of a loss unit, each (N,) over the batch's trained tokens unless noted."""

    logprobs: torch.Tensor | None
    """The policy's log-probs now, with grad (None for a unit that scores hidden states itself)."""
    row: torch.Tensor
    """Long: the sequence (rollout) each token belongs to, 0..rows-1."""
    rows: int
    """B, the sequences of this (micro-)batch."""
    row_tokens: torch.Tensor
    """Float: how many trained tokens the token's sequence has (all of them, also in a chunk)."""
    normalizer: float | None = None
    """The FULL batch's denominator of the unit's aggregate; None: this batch's own (`normalizer`)."""
    advantages: torch.Tensor | None = None
    """Each token's advantage (a rollout's advantage repeated on its tokens, or per token)."""
    old_logprobs: torch.Tensor | None = None
    """The trainer's own log-probs before the update; NaN where not computed (on-policy there)."""
    sampler_logprobs: torch.Tensor | None = None
    """The generator's, as sampled; NaN where unknown; None when no rollout carries any."""
    ref_logprobs: torch.Tensor | None = None
    """The reference policy's (a KL penalty)."""
    teacher_logprobs: torch.Tensor | None = None
    """A distillation teacher's log-probs of the same tokens."""
    entropy: torch.Tensor | None = None
    """The policy's entropy at each token (reported; a unit may train on it)."""
    values: torch.Tensor | None = None
    """A critic's values, with grad; `old_values` and `returns` beside them (PPO)."""
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    group: torch.Tensor | None = None
    """(B,) long: each sequence's group (the rollouts of one prompt)."""
    temperature: float = 1.0
    """The sampling temperature the log-probs are computed at."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """What a unit needs beside these (e.g. the JSD's hidden states and heads)."""

    @property
    def num_tokens(self) -> int:
        return self.row.shape[0]

    def chunk(self, sl: slice, logprobs: torch.Tensor) -> LossInputs:
        """The tokens `sl` with `logprobs` (n,) as theirs; per-sequence facts (row_tokens, rows) stay whole."""
        cut = {f.name: getattr(self, f.name)[sl] for f in fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor) and f.name != "group"}
        return replace(self, **{**cut, "logprobs": logprobs})

    @classmethod
    def from_tokens(cls, mask: torch.Tensor, normalizer: float | None = None, **tensors) -> LossInputs:
        """From (B, T) tensors aligned with input_ids: the tokens where `mask` is set (column 0 never).

        tensors: `LossInputs` fields as (B, T) tensors, or (B,) for `advantages` (per rollout) and `group`."""
        select = mask.bool().clone()
        select[:, 0] = False  # nothing predicts the first token
        B = mask.shape[0]
        row = torch.arange(B, device=mask.device)[:, None].expand_as(select)[select]  # (N,)
        picked = {}
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and name != "group":
                t = t.to(mask.device)
                picked[name] = t.index_select(0, row) if t.dim() == 1 else t[select]
            else:
                picked[name] = t
        counts = select.sum(-1).float()  # (B,)
        return cls(row=row, rows=B, row_tokens=counts.index_select(0, row), normalizer=normalizer,
                   **{"logprobs": None, **picked})


class LossOutput(NamedTuple):
    """What every loss unit (and every front's `compute`) returns.

    loss: the scalar loss with grad, a share of the full batch's when a normalizer was passed.
    metrics: a `LazyMetrics` of 0-dim tensors, each with its reduction (`combine_metrics`).
    token_logprobs: the trained tokens' log-probs, detached: (N,) from a unit, (B, T) from a
    front's `compute` (NaN where not trained).
    """

    loss: torch.Tensor
    metrics: dict
    token_logprobs: torch.Tensor


# ---------------------------------------------------------------- metrics that carry their reduction


class Reduce(NamedTuple):
    """How one metric combines over micro-batches: "sum", "mean" (weighted by the metric `weight`),
    "min", "max", "first" (the same in every part), or "derived" (`derive(combined metrics)`)."""

    how: str
    weight: str | None = None
    derive: Callable[[dict], Any] | None = None


SUM, MIN, MAX, FIRST = Reduce("sum"), Reduce("min"), Reduce("max"), Reduce("first")
TOKEN_MEAN = Reduce("mean", "num_tokens")  # a mean over the trained tokens
SEQUENCE_MEAN = Reduce("mean", "num_sequences")  # a mean over the rollouts


class LazyMetrics(dict):
    """A dict of metrics whose tensor values become numbers on the first read, all in one transfer.

    Units put 0-dim tensors here (no `.item()`, which would wait for the device mid-step); reading a
    value, iterating, `dict(m)` or `json.dumps(m)` after `backward()` materializes them all at once.
    `reductions` says how each combines over micro-batches; a value without one is "first"."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reductions: dict[str, Reduce] = {}
        self._lazy = any(isinstance(v, torch.Tensor) for v in dict.values(self))

    @classmethod
    def of(cls, **named: tuple[Any, Reduce]) -> LazyMetrics:
        """`LazyMetrics.of(loss=(x, SUM), entropy=(e, TOKEN_MEAN))`: values with their reductions."""
        out = cls({k: v for k, (v, _) in named.items()})
        out.reductions = {k: r for k, (_, r) in named.items()}
        return out

    @classmethod
    def merged(cls, *parts, **extra) -> LazyMetrics:
        """The parts' entries and reductions in order (later ones win), materializing none of them."""
        out = cls()
        for part in (*parts, extra):
            dict.update(out, dict.items(part))
            out.reductions.update(getattr(part, "reductions", {}))
        out._lazy = any(isinstance(v, torch.Tensor) for v in dict.values(out))
        return out

    def materialize(self) -> LazyMetrics:
        """Turn every tensor value into a number (one device-to-host copy; ints stay ints); returns self."""
        keys = [k for k, v in dict.items(self) if isinstance(v, torch.Tensor)] if self._lazy else []
        if keys:
            tensors = [dict.__getitem__(self, k).detach() for k in keys]
            values = torch.stack([t.reshape(()).to(torch.float64) for t in tensors]).tolist()
            for k, t, v in zip(keys, tensors, values, strict=True):
                dict.__setitem__(self, k, v if t.is_floating_point() or t.is_complex() else int(v))
        self._lazy = False
        return self

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, value)
        self._lazy = self._lazy or isinstance(value, torch.Tensor)

    def __getitem__(self, key):
        return dict.__getitem__(self.materialize(), key)

    def get(self, key, default=None):
        return dict.get(self.materialize(), key, default)

    def __iter__(self):  # also takes `dict(m)` / `{**m}` off CPython's raw-storage fast path
        return dict.__iter__(self.materialize())

    def items(self):
        return dict.items(self.materialize())

    def values(self):
        return dict.values(self.materialize())

    def __repr__(self) -> str:
        return dict.__repr__(self.materialize())

    def __eq__(self, other):
        return dict.__eq__(self.materialize(), other)

    __hash__ = None

    def __reduce__(self):
        return dict, (dict(self.items()),)


def combine_metrics(parts: list[dict]) -> dict[str, float]:
    """The metrics of one batch from the `LazyMetrics` of its micro-batches, each metric by its own reduction.

        outs = [grpo.compute(micro) for micro in prepared.split(4)]    # each: loss.backward() too
        metrics = combine_metrics([o.metrics for o in outs])           # what one full-batch call reports

    Sums (each part's loss carries the FULL batch's normalizer), means weighted by a count metric, min /
    max, values derived from the combined ones (the off-policy ESS), batch-level numbers kept once."""
    if not parts:
        raise ValueError("combine_metrics needs the metrics of at least one micro-batch")
    missing = [i for i, p in enumerate(parts) if not hasattr(p, "reductions")]
    if missing:
        raise TypeError(f"combine_metrics: parts {missing} carry no reductions; pass the `metrics` of the "
                        "LossOutputs (a LazyMetrics), not plain dicts")
    out: dict[str, float] = {}
    derived = {}
    for key in dict.fromkeys(k for p in parts for k in p):  # first-seen order
        present = [p for p in parts if key in p]
        how = next((p.reductions[key] for p in present if key in p.reductions), FIRST)
        values = [p[key] for p in present]
        if how.how == "sum":
            out[key] = sum(values)
        elif how.how in ("min", "max"):
            out[key] = (min if how.how == "min" else max)(values)
        elif how.how == "mean":
            weights = [p.get(how.weight) for p in present]
            if any(w is None for w in weights):
                raise ValueError(f"combine_metrics: {key!r} is a mean weighted by {how.weight!r}, which a part lacks")
            total = sum(weights)
            out[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0
        elif how.how == "derived":
            derived[key] = how.derive
            out[key] = values[0]
        else:
            out[key] = values[0]
    out.update({key: derive(out) for key, derive in derived.items()})  # from the combined values
    return out


def count(n: int, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim long tensor on `like`'s device holding a host-known count (a fill: no copy, no sync)."""
    return torch.full((), n, dtype=torch.long, device=like.device)


# ---------------------------------------------------------------- what "old" means


def old_logprobs(current: torch.Tensor, trainer: torch.Tensor | None = None, sampled: torch.Tensor | None = None,
                 off_policy=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the old log-probs of the importance ratio, the trainer's old log-probs), elementwise, detached.

    The one place "old" is decided. current: the policy's log-probs now; trainer: its own before
    the update, NaN (or None) where not computed: there the current policy's (on-policy, ratio 1);
    sampled: the generator's, NaN where unknown. Without an off-policy correction the sampler's
    log-probs are the old policy where known (no extra forward); with one, the ratio uses the
    trainer's own (decoupled PPO) and the correction reweights by pi_trainer / pi_sampler.
    """
    current = current.detach()
    own = current if trainer is None else torch.where(torch.isnan(trainer), current, trainer.to(current.dtype))
    if off_policy is not None or sampled is None:
        return own, own
    return torch.where(torch.isnan(sampled), own, sampled.to(own.dtype)), own


def needs_old_pass(sampled: torch.Tensor | None, mask: torch.Tensor, off_policy=None) -> bool:
    """Whether `old_logprobs` reads the trainer's own old log-probs beyond the current policy (a no-grad pass
    before the update): with an off-policy correction, or where the sampler's are unknown. Waits for the device."""
    return off_policy is not None or sampled is None or bool(torch.isnan(sampled[mask.bool()]).any())


# ---------------------------------------------------------------- aggregation


AGGREGATES = ("token_mean", "sequence_mean_token_mean", "token_sum_constant")


def check_aggregate(name: str, where: str) -> None:
    """ValueError naming `where` unless `name` is one of `AGGREGATES`."""
    if name not in AGGREGATES:
        raise ValueError(f"{where} aggregate={name!r} is invalid; expected one of {AGGREGATES}")


def normalizer(aggregate: str, mask: torch.Tensor, max_tokens: int | None = None) -> float:
    """The FULL batch's denominator of `aggregate` from its (B, T) trained-token mask (give it to every
    micro-batch): trained tokens (token_mean), rows (sequence_mean_token_mean) or rows x max_tokens
    (token_sum_constant; None: the longest row)."""
    check_aggregate(aggregate, "normalizer")
    if aggregate == "token_mean":
        return float(mask.sum())
    if aggregate == "sequence_mean_token_mean":
        return float(mask.shape[0])
    per_row = max_tokens if max_tokens is not None else int(mask.sum(-1).max())
    return float(mask.shape[0] * per_row)


def weights(aggregate: str, inputs: LossInputs, max_tokens: int | None = None) -> torch.Tensor:
    """(n,) per-token weights w with `(x * w).sum()` the aggregate of per-token values x.

    token_mean: 1 / normalizer (DAPO, BNPO, CISPO, PPO, SFT); sequence_mean_token_mean: 1 / (the
    row's tokens x normalizer) (GRPO, GSPO); token_sum_constant: 1 / normalizer (Dr. GRPO)."""
    check_aggregate(aggregate, "weights")
    norm = inputs.normalizer
    if norm is None:  # this batch's own
        per_row = max_tokens if max_tokens is not None else float(inputs.row_tokens.max()) if inputs.num_tokens else 0
        norm = {"token_mean": inputs.num_tokens, "sequence_mean_token_mean": inputs.rows}.get(
            aggregate, inputs.rows * per_row)
    w = torch.full_like(inputs.row_tokens, 1.0 / max(float(norm), 1.0))
    return w / inputs.row_tokens.clamp(min=1) if aggregate == "sequence_mean_token_mean" else w


# ---------------------------------------------------------------- KL estimators (samples from pi)


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log ref (unbiased, high variance)."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi - log ref)^2 / 2."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = ref/pi - log(ref/pi) - 1 >= 0 (unbiased, low variance; GRPO's choice)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1, "k2": kl_k2, "k3": kl_k3,
}

# ---------------------------------------------------------------- the PPO clip


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
    """PPO-clip: -min(r A, clip(r, 1-low, 1+high) A), optional dual clip; elementwise.

    Returns (loss, flags): flags' "clipped_low" / "clipped_high" mark the tokens whose gradient the
    clip removed (low side: r < 1-low, A < 0; high side: r > 1+high, A > 0).
    """
    ratio = torch.exp(log_ratio)
    loss = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip.low, 1 + clip.high) * adv)
    if clip.dual is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -clip.dual * adv), loss)
    return loss, {"clipped_low": (ratio < 1 - clip.low) & (adv < 0), "clipped_high": (ratio > 1 + clip.high) & (adv > 0)}


def ratio_metrics(ratio: torch.Tensor, flags: dict) -> dict:
    """The ratio's mean / min / max and the clip fractions of (n,) tokens, with their reductions."""
    low, high = flags["clipped_low"].float().mean(), flags["clipped_high"].float().mean()
    return dict(ratio_mean=(ratio.mean(), TOKEN_MEAN), ratio_min=(ratio.min(), MIN), ratio_max=(ratio.max(), MAX),
                clip_frac_low=(low, TOKEN_MEAN), clip_frac_high=(high, TOKEN_MEAN), clip_frac=(low + high, TOKEN_MEAN))


# ---------------------------------------------------------------- the sampler-vs-trainer mismatch


SEQUENCE_LOG_CAP = 20.0  # |sum_t log rho| cap of the sequence chi-square metric (exp(40) stays finite)


def per_row(values: torch.Tensor, row: torch.Tensor, rows: int) -> torch.Tensor:
    """(B,) sums of the (n,) values of each row."""
    return torch.zeros(rows, dtype=values.dtype, device=values.device).index_add(0, row, values)


def token_log_rho(trainer_old: torch.Tensor, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log rho (n,), known (n,) bool): log pi_trainer - log pi_sampler, 0 where the sampler's is unknown."""
    known = ~torch.isnan(sampled)
    return torch.where(known, trainer_old.detach() - torch.where(known, sampled, 0.0), 0.0), known


def _ess(m: dict):
    return m["offpolicy_ratio_mean"] ** 2 / (m["offpolicy_chi2_token"] + 1)


def _ppl_ratio(m: dict):
    k1 = m["offpolicy_kl_k1"]
    return torch.exp(k1) if isinstance(k1, torch.Tensor) else math.exp(k1)


@torch.no_grad()
def mismatch_metrics(trainer_old: torch.Tensor, sampled: torch.Tensor, row: torch.Tensor, rows: int) -> dict:
    """KL(sampler || trainer) (k1, k3), chi-square (token, sequence), ESS and perplexity ratio, with reductions.

    Means over the (n,) trained tokens (unknown sampler log-probs count as rho = 1) or the B rows;
    `offpolicy_ess` and `offpolicy_ppl_ratio` are derived from the combined means (micro-batch invariant):

        kl_k1 = mean(-log rho)              (E_sampler[log pi_sampler - log pi_trainer])
        kl_k3 = mean(rho - 1 - log rho)     (>= 0, low variance)
        chi2_token = mean(rho^2) - 1        chi2_seq = mean_rows(prod_t rho_t ^ 2) - 1
        ess = mean(rho)^2 / mean(rho^2)     (normalized effective sample size, in (0, 1])
        ppl_ratio = exp(kl_k1)              (PPL_trainer / PPL_sampler)
    """
    log_rho, _ = token_log_rho(trainer_old.float(), sampled.float())
    rho = torch.exp(log_rho)
    seq = per_row(log_rho, row, rows).clamp(-SEQUENCE_LOG_CAP, SEQUENCE_LOG_CAP)  # (B,)
    out = {"offpolicy_kl_k1": ((-log_rho).mean(), TOKEN_MEAN), "offpolicy_kl_k3": ((rho - 1 - log_rho).mean(), TOKEN_MEAN),
           "offpolicy_ratio_mean": (rho.mean(), TOKEN_MEAN), "offpolicy_chi2_token": ((rho * rho - 1).mean(), TOKEN_MEAN),
           "offpolicy_chi2_seq": ((torch.exp(2 * seq) - 1).mean(), SEQUENCE_MEAN)}
    values = {k: v for k, (v, _) in out.items()}
    out["offpolicy_ess"] = (_ess(values), Reduce("derived", derive=_ess))
    out["offpolicy_ppl_ratio"] = (_ppl_ratio(values), Reduce("derived", derive=_ppl_ratio))
    return out
