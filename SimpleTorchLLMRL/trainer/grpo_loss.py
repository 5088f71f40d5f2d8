"""The GRPO family's loss as one pure unit: trained tokens in, `LossOutput(loss, metrics, token_logprobs)` out.

Legend: B rollouts, T tokens, N trained tokens of the batch, n of a chunk, H hidden size.

    x = token_inputs(tb, select, normalizer, config)          # constants of the per-token loss, (N,)
    out = grpo_loss(h, head, y, x, config, temperature=...)   # LossOutput(loss, metrics, token_logprobs (N,))

    # the same loss on (B, T) log-prob tensors, keyword-only inputs named by source:
    out = grpo_token_loss(logprobs=lp, advantages=adv, mask=mask, config=config, old_logprobs=old,
                          sampler_logprobs=sampled, ref_logprobs=ref, normalizer=n)

`metrics` are in the form `combine_metrics` adds up over micro-batches:
`loss` (a share of the full-batch loss), token means with `num_tokens`, min / max. They are a
`LazyMetrics` of 0-dim tensors (nothing here waits for the device); reading one materializes them.

On the GPU kernels the head runs in two passes (`model.scoring.head_autograd._TwoPassHead`): chunked log-probs
and entropy without autograd, then this loss once on the (N,) tensors with autograd, and the
logits recomputed chunk by chunk in backward. On the "cpu" kernel, and with `fused=True`, the
gradient is formed chunk by chunk in the forward instead (`fused_token_loss`: one logits pass
less, an autograd graph of the loss per chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from SimpleTorchLLMRL.model.scoring.head import supports_fused
from SimpleTorchLLMRL.model.scoring.logprobs import fused_token_loss, logprobs_from_hidden, resolve_head_impl
from SimpleTorchLLMRL.trainer import advantages as A
from SimpleTorchLLMRL.trainer.batch import TrainBatch
from SimpleTorchLLMRL.trainer.combine import LazyMetrics
from SimpleTorchLLMRL.trainer.losses import (
    KL_ESTIMATORS,
    LOSS_TYPES,
    RATIO_LEVELS,
    Clip,
    LossOutput,
    old_and_tis,
    sequence_log_ratio,
)
from SimpleTorchLLMRL.trainer.off_policy import (
    OffPolicy,
    as_off_policy,
    correction_metrics,
    correction_weights,
    mismatch_metrics,
)


@dataclass
class GRPOConfig:
    """The options that change GRPO's math; each is also a keyword argument of `GRPO`.

    Loss: loss_type "grpo" | "dr_grpo" | "dapo" | "bnpo" | "gspo" | "cispo" (see losses.LOSS_TYPES);
    eps / eps_high: clip range [1 - eps, 1 + eps_high] (eps_high None: eps, 0.28 for dapo);
    dual_clip: c > 1 caps the loss of negative advantages at -c A (None: off);
    importance_sampling_level: "token" | "sequence" (GSPO; forced by loss_type="gspo");
    max_tokens: Dr. GRPO's per-sequence constant, required for loss_type="dr_grpo": the generation budget
    (the generator's max_new_tokens; times the model turns for multi-turn episodes), as in the paper and
    TRL's max_completion_length. A batch-dependent constant would rescale the loss from batch to batch.

    KL: beta (0 skips the reference pass); kl_estimator k1 | k2 | k3; kl_bias_correction: multiply the
    per-token KL by the importance ratio pi/pi_old (DeepSeek-V3.2; TRL's use_bias_correction_kl).

    Off-policy: off_policy, an `OffPolicy` (or a dict of its fields): token / sequence / geometric ratios
    between the trainer's and the sampler's log-probs, truncated, masked or rejected, and the DeepSeek-V3.2
    mask (`trainer.off_policy`); tis_cap=c is its old spelling of OffPolicy.tis(c) (truncated importance
    sampling, min(pi_trainer / pi_sampler, c)). With either, the ratio uses the trainer's own old log-probs.
    temperature: None (default) follows the temperature the rollouts were sampled at (1.0 when none is
    recorded); a number is used when the rollouts record none (the recorded one wins, with a warning).

    Advantages: advantage_estimator "group" (GRPO), "rloo" or "reinforce++"; group_size: consecutive
    blocks of G (None: metadata["group_id"], else identical prompts); scale_rewards True/"group",
    "batch", False/"none" (Dr. GRPO uses False); reward_eps: the std floor.
    """

    eps: float = 0.2
    eps_high: float | None = None
    beta: float = 0.0
    loss_type: str = "grpo"
    importance_sampling_level: str = "token"
    group_size: int | None = None
    scale_rewards: bool | str = True
    temperature: float | None = None
    advantage_estimator: str = "group"
    kl_estimator: str = "k3"
    tis_cap: float | None = None
    off_policy: OffPolicy | dict | None = None
    max_tokens: int | None = None
    dual_clip: float | None = None
    kl_bias_correction: bool = False
    reward_eps: float = 1e-4

    def __post_init__(self):
        def bad(name, allowed):
            raise ValueError(f"GRPO {name}={getattr(self, name)!r} is invalid; expected {allowed}")

        if self.loss_type not in LOSS_TYPES:
            bad("loss_type", f"one of {sorted(LOSS_TYPES)}")
        if self.importance_sampling_level not in RATIO_LEVELS:
            bad("importance_sampling_level", f"one of {RATIO_LEVELS}")
        if self.advantage_estimator not in A.ADVANTAGE_ESTIMATORS:
            bad("advantage_estimator", f"one of {A.ADVANTAGE_ESTIMATORS}")
        if self.kl_estimator not in KL_ESTIMATORS:
            bad("kl_estimator", f"one of {sorted(KL_ESTIMATORS)}")
        if self.scale_rewards not in (True, False, "group", "batch", "none"):
            bad("scale_rewards", "True, False, 'group', 'batch' or 'none'")
        for name, ok, allowed in [
            ("beta", self.beta >= 0, ">= 0"),
            ("temperature", self.temperature is None or self.temperature > 0, "None or > 0"),
            ("group_size", self.group_size is None or self.group_size >= 1, "None or an int >= 1"),
            ("tis_cap", self.tis_cap is None or self.tis_cap > 0, "None or > 0"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "None or an int >= 1"),
            ("reward_eps", self.reward_eps >= 0, ">= 0"),
        ]:
            if not ok:
                bad(name, allowed)
        if self.loss_type == "dr_grpo" and self.max_tokens is None:
            raise ValueError("GRPO loss_type='dr_grpo' needs max_tokens=: its fixed per-sequence constant, the "
                             "generation budget (your generator's max_new_tokens, times the model turns for "
                             "multi-turn episodes)")
        self.off_policy = as_off_policy("GRPO", self.off_policy, self.tis_cap)
        spec = LOSS_TYPES[self.loss_type]
        if self.eps_high is None:
            self.eps_high = spec.default_eps_high if spec.default_eps_high is not None else self.eps
        self.clip = Clip(self.eps, self.eps_high, self.dual_clip)  # raises on eps / eps_high / dual_clip

    @property
    def spec(self):
        return LOSS_TYPES[self.loss_type]

    @property
    def ratio_level(self) -> str:
        return self.spec.ratio_level or self.importance_sampling_level


class TokenInputs(NamedTuple):
    """The per-token constants of GRPO's loss, each (N,) over the batch's N trained tokens, named by source."""

    advantages: torch.Tensor  # the rollout's advantage, repeated on each of its tokens
    old_logprobs: torch.Tensor  # recomputed by the trainer before the update (NaN: not computed, on-policy)
    sampler_logprobs: torch.Tensor  # the generator's (NaN where unknown)
    ref_logprobs: torch.Tensor | None  # the reference policy's (None when beta == 0)
    weight: torch.Tensor  # the aggregator's weight of each token (normalizer included)
    row: torch.Tensor  # long: the rollout each token belongs to
    rows: int  # B
    has_sampled: bool = False  # whether the batch carries sampler log-probs (the mismatch metrics)


def token_inputs(tb: TrainBatch, select: torch.Tensor, normalizer: float, config: GRPOConfig) -> TokenInputs:
    """Constants of the per-token loss over the trained tokens. NaN trainer_old = the current policy.

    select: (B, T-1) bool, token t+1 is trained (predicted from position t); or the (N,) long
    `batch.trained_index` of the same tokens, which reads them without a host sync."""
    mask = tb.mask
    B, T = mask.shape
    if select.dtype == torch.bool:
        pick = lambda t: t[:, 1:][select]  # noqa: E731  (B, T) -> (N,)
        row = pick(torch.arange(B, device=mask.device)[:, None].expand_as(mask))
    else:
        target = select + 1  # (N,) flat positions of the trained tokens
        pick = lambda t: t.reshape(-1).index_select(0, target)  # noqa: E731  (B, T) -> (N,)
        row = torch.div(select, T, rounding_mode="floor")
    nan = torch.full(row.shape, torch.nan, device=mask.device)  # (N,)
    return TokenInputs(
        advantages=tb.advantages.float().index_select(0, row),
        old_logprobs=pick(tb.old_logprobs) if tb.old_logprobs is not None else nan,
        sampler_logprobs=pick(tb.sampler_logprobs) if tb.sampler_logprobs is not None else nan,
        ref_logprobs=pick(tb.ref_logprobs) if tb.ref_logprobs is not None else None,
        weight=pick(config.spec.aggregator.weights(mask, normalizer)),
        row=row,
        rows=B,
        has_sampled=tb.sampler_logprobs is not None,
    )


def token_terms(config: GRPOConfig, x: TokenInputs, lp: torch.Tensor, sl: slice):
    """(weighted per-token loss (n,), stats) for the trained tokens `sl`, from their log-probs lp (n,)."""
    trainer_old = torch.where(torch.isnan(x.old_logprobs[sl]), lp.detach(), x.old_logprobs[sl])
    sampled = x.sampler_logprobs[sl]
    op = config.off_policy
    old, _ = old_and_tis(trainer_old, sampled, None, None)  # as PPO decides it: the sampler's where known
    tis = None
    if op is not None:  # decoupled: the ratio against the trainer's own, the sampler's corrected by a weight
        old = trainer_old
        tis, correction = correction_weights(op, trainer_old, sampled, x.row[sl], x.rows, x.advantages[sl], lp)
    if config.ratio_level == "sequence":  # GSPO: one length-normalized ratio per rollout (needs every token)
        log_ratio = sequence_log_ratio(lp - old, x.row, x.rows)
    else:
        log_ratio = lp - old
    loss, stats = config.spec.policy_loss(log_ratio, lp, x.advantages[sl], config.clip)
    stats["log_ratio"] = log_ratio
    stats["trainer_old"] = trainer_old
    if tis is not None:
        stats["tis"], stats["correction"] = tis, correction
        loss = loss * tis
    if config.beta > 0:
        stats["kl"] = KL_ESTIMATORS[config.kl_estimator](lp, x.ref_logprobs[sl])
        kl = stats["kl"] * torch.exp(log_ratio) if config.kl_bias_correction else stats["kl"]
        loss = loss + config.beta * kl
    return loss * x.weight[sl], stats


def grpo_loss(h: torch.Tensor, head, y: torch.Tensor, x: TokenInputs, config: GRPOConfig, *, temperature: float,
              chunk_size: int | None = None, softcap: float | None = None, fused: bool | None = None,
              head_impl: str = "auto", truncation=None) -> LossOutput:
    """The loss of the trained tokens: h (N, H) hidden states that predict y (N,) through `head`.

    fused False: the two-pass head (chunked log-probs and entropy, this loss once with autograd,
    logits recomputed in backward). fused True (token-level ratios and off-policy weights, plain Linear head): the
    gradient is formed chunk by chunk in the forward (`fused_token_loss`). None: by kernel, fused
    on the "cpu" one (where the extra logits pass of the two-pass head costs more than a per-chunk
    loss graph: docs/benchmarks.md), two-pass on "gpu" / "triton" (where per-chunk launches and
    graphs are the cost). Same values either way.
    head_impl: the chunk kernel of `model.scoring.logprobs`, "auto" | "cpu" | "gpu" | "triton".
    truncation: the (N,) top-k / top-p / min-p of y's draws (`chat.truncation.Truncation`), None: full softmax.
    """
    opts = dict(temperature=temperature, chunk_size=chunk_size, head_impl=head_impl, truncation=truncation)
    if fused is None:
        fused = resolve_head_impl(head_impl, h.device) == "cpu"
    whole = config.ratio_level == "sequence" or (config.off_policy is not None
                                                  and config.off_policy.needs_whole_sequences)
    if fused and not whole and supports_fused(head, softcap):
        loss, logp, entropy = fused_token_loss(h, head, y, lambda lp, sl: token_terms(config, x, lp, sl)[0], **opts)
        stats = None
    else:
        logp, entropy = logprobs_from_hidden(h, head, y, softcap=softcap, **opts)
        terms, stats = token_terms(config, x, logp, slice(None))
        loss = terms.sum()
        logp = logp.detach()
    return LossOutput(loss, grpo_metrics(config, x, loss, logp, entropy, stats), logp)


@torch.no_grad()
def grpo_metrics(config: GRPOConfig, x: TokenInputs, loss: torch.Tensor, logp: torch.Tensor,
                 entropy: torch.Tensor | None, stats: dict | None = None) -> LazyMetrics:
    """Loss, entropy, ratio and clip statistics of one (micro-)batch, in `combine_metrics`' form.

    stats: `token_terms`' statistics of these log-probs when the loss already computed them.
    The values are 0-dim tensors (no host sync) until the returned `LazyMetrics` is read."""
    st = stats if stats is not None else token_terms(config, x, logp, slice(None))[1]
    ratio = torch.exp(st["log_ratio"].detach())
    mean = lambda t: t.detach().float().mean()  # noqa: E731
    count = lambda n: torch.full((), n, dtype=torch.long, device=logp.device)  # noqa: E731  a fill, no copy
    low, high = mean(st["clipped_low"]), mean(st["clipped_high"])
    out = LazyMetrics(loss=loss.detach())
    if entropy is not None:
        out["entropy"] = mean(entropy)
    out.update(ratio_mean=mean(ratio), ratio_min=ratio.min(), ratio_max=ratio.max(), clip_frac_low=low,
               clip_frac_high=high, num_tokens=count(logp.numel()), num_sequences=count(x.rows),
               clip_frac=low + high)
    if "kl" in st:
        out["kl"] = mean(st["kl"])
    if "tis" in st:  # the off-policy correction: its mean weight, the fractions clipped and masked
        out.update(correction_metrics(st["tis"], st["correction"]))
    if x.has_sampled:  # KL / chi-square / ESS / perplexity ratio between the sampler and the trainer
        out.update(mismatch_metrics(st["trainer_old"], x.sampler_logprobs, x.row, x.rows))
    return out


def grpo_token_loss(*, logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: GRPOConfig,
                    old_logprobs: torch.Tensor | None = None, sampler_logprobs: torch.Tensor | None = None,
                    ref_logprobs: torch.Tensor | None = None, normalizer: float | None = None,
                    entropy: torch.Tensor | None = None) -> LossOutput:
    """The GRPO family's loss on (B, T) log-prob tensors, the same math as `grpo_loss` without the head.

    logprobs (B, T) with grad (e.g. `model.scoring.logprobs.token_logprobs(..., positions=mask)`);
    advantages (B,); mask (B, T) 1 on trained tokens; old_logprobs (B, T) the trainer's before
    the update (None or NaN: on-policy, `logprobs` detached); sampler_logprobs (B, T) the
    generator's (NaN where unknown); ref_logprobs (B, T), needed when config.beta > 0;
    normalizer: the FULL batch's (None: this batch's, `config.spec.aggregator.normalizer`);
    entropy (B, T): reported as the `entropy` metric when given. Returns `LossOutput(loss,
    metrics, token_logprobs (B, T) detached)`. Waits for the device once (finding the trained tokens).
    """
    if config.beta > 0 and ref_logprobs is None:
        raise ValueError(f"grpo_token_loss: config.beta={config.beta} > 0 needs ref_logprobs=")
    for name, t in (("mask", mask), ("old_logprobs", old_logprobs), ("sampler_logprobs", sampler_logprobs),
                    ("ref_logprobs", ref_logprobs), ("entropy", entropy)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"grpo_token_loss: {name} has shape {tuple(t.shape)}, logprobs {tuple(logprobs.shape)}")
    B, T = mask.shape
    select = mask.bool()  # (B, T)
    select[:, 0] = False  # nothing predicts the first token
    row = torch.arange(B, device=mask.device)[:, None].expand(B, T)[select]  # (N,)
    nan = torch.full(row.shape, torch.nan, device=mask.device)
    norm = normalizer if normalizer is not None else config.spec.aggregator.normalizer(select, config.max_tokens)
    x = TokenInputs(advantages=advantages.float().to(mask.device).index_select(0, row),
                    old_logprobs=old_logprobs[select].float() if old_logprobs is not None else nan,
                    sampler_logprobs=sampler_logprobs[select].float() if sampler_logprobs is not None else nan,
                    ref_logprobs=ref_logprobs[select].float() if ref_logprobs is not None else None,
                    weight=config.spec.aggregator.weights(select, norm)[select], row=row, rows=B,
                    has_sampled=sampler_logprobs is not None)
    lp = logprobs[select]  # (N,) with grad
    terms, stats = token_terms(config, x, lp, slice(None))
    loss = terms.sum()
    metrics = grpo_metrics(config, x, loss, lp.detach(), None if entropy is None else entropy[select], stats)
    return LossOutput(loss, metrics, logprobs.detach())
