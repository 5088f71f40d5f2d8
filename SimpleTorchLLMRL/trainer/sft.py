"""Supervised fine-tuning from rollouts: cross-entropy on the trainable tokens, through the chunked head.

Legend: B rollouts, T tokens (per-token tensors are (B, T), aligned with input_ids).

    sft = SFT(model, tokenizer)
    loss = sft.calculate_loss(demonstrations)         # mean NLL of the trainable tokens
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Mixed with an RL loss in your own loop, as a weighted sum:

    loss = grpo.calculate_loss(rollouts, rewards) + 0.1 * sft.calculate_loss(demonstrations)

The trained tokens are exactly `encode_rollout`'s loss mask (trainable MODEL turns; a
hand-written reply covers its content and end-of-turn token), so SFT sees the encoding RL uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.model.scoring.head import check_vocabulary
from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs
from SimpleTorchLLMRL.trainer.batch import (
    TrainBatch,
    encode,
    model_device,
    trained_mask,
    warn_if_dropout,
)
from SimpleTorchLLMRL.trainer.combine import LazyMetrics
from SimpleTorchLLMRL.trainer.losses import AGGREGATORS, LossOutput, aggregation_weights, default_normalizer
from SimpleTorchLLMRL.trainer.options import (
    UNSET,
    ComputeOptions,
    build_options,
    named_options,
    old_third_argument,
    one_of,
)

__all__ = ["SFT", "SFTConfig", "sft_loss"]


def sft_loss(*, logprobs: torch.Tensor, mask: torch.Tensor, aggregate: str = "token_mean",
             normalizer: float | None = None) -> LossOutput:
    """Cross-entropy -sum_t w_t log p(y_t) of the trained tokens; `LossOutput(loss, metrics, logprobs detached)`.

    logprobs (B, T): log-probs of input_ids with grad (`model.scoring.logprobs.token_logprobs`, at
    temperature 1); mask (B, T): 1 on trained tokens. aggregate / normalizer: the weights w of
    `losses.aggregation_weights` ("token_mean": the mean NLL per token; pass the FULL batch's
    token count as normalizer when micro-batching). Metrics: loss, nll (token mean), num_tokens,
    num_sequences.
    """
    if logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and mask {tuple(mask.shape)} must have one shape (B, T)")
    m = mask.bool()
    lp = torch.where(m, logprobs, torch.zeros_like(logprobs))
    w = aggregation_weights(aggregate, m, normalizer).to(lp.dtype)
    loss = -(lp * w).sum()
    n = m.sum()
    metrics = {"loss": loss.detach(), "nll": -lp.detach().float().sum() / n.clamp(min=1), "num_tokens": n,
               "num_sequences": torch.full((), m.shape[0], dtype=torch.long, device=m.device)}
    return LossOutput(loss, metrics, logprobs.detach())


@dataclass
class SFTConfig:
    """The option that changes the math; also a keyword argument of `SFT`.

    aggregate: how the per-token NLL is weighted, "token_mean" (default) | "sequence_mean_token_mean" |
    "token_sum_constant" (`losses.AGGREGATORS`)."""

    aggregate: str = "token_mean"

    def __post_init__(self):
        if self.aggregate not in AGGREGATORS:
            raise ValueError(f"SFT aggregate={self.aggregate!r} is invalid; expected one of {sorted(AGGREGATORS)}")


_NOT_OPTIONS = frozenset({"self", "model", "tokenizer", "config", "compute", "positional"})


class SFT:
    """Cross-entropy on the trainable tokens of `Rollout`s; `calculate_loss(rollouts)` returns a scalar tensor.

    `SFT(model, tokenizer, config=None, compute=None, **options)`, as `GRPO`: options are `SFTConfig`'s
    (aggregate) and `ComputeOptions`' (chunk_size, head_impl, share_prefix, max_length, truncate; `fused` is
    accepted and has no effect: the loss is not a clipped surrogate), each a named keyword argument; an unknown
    one raises `UnknownOptionError` (a TypeError). `SFT(model, tokenizer, "token_mean")` (the aggregate as
    third positional argument) still works. `metrics` and `token_logprobs` record the last loss call.
    """

    name = "SFT"

    @named_options
    def __init__(self, model, tokenizer, config: SFTConfig | str | None = None, compute: ComputeOptions | None = None,
                 *, aggregate: str = UNSET,
                 chunk_size: int | None = UNSET, head_impl: str = UNSET, max_length: int | None = UNSET,
                 truncate: bool = UNSET, fused: bool | None = UNSET, share_prefix: bool = UNSET):
        """config: an `SFTConfig`, compute: `ComputeOptions`; each keyword overrides its field."""
        config, positional = old_third_argument(config, SFTConfig, lambda x: isinstance(x, str))
        aggregate = one_of(self.name, "aggregate", aggregate, positional)
        given = {k: v for k, v in locals().items() if k not in _NOT_OPTIONS}
        self.config, self.compute_options = build_options(self.name, SFTConfig, config, compute, given)
        check_vocabulary(model, tokenizer)
        self.model, self.tokenizer = model, tokenizer
        self.metrics: dict = LazyMetrics()  # the last loss call's metrics (tensors until read)
        self.token_logprobs: torch.Tensor | None = None  # (B, T) of the last loss call, NaN where not trained
        self._dropout_checked = False

    @property
    def aggregate(self) -> str:
        return self.config.aggregate

    def prepare(self, rollouts: list[Rollout]) -> TrainBatch:
        """Encode once (micro-batches via `.split(n)` keep the full batch's normalizer)."""
        o = self.compute_options
        batch = encode(self.name, rollouts, self.tokenizer, model_device(self.model), o.max_length, o.truncate)
        mask = trained_mask(batch)
        return TrainBatch(batch, mask, torch.zeros(len(batch), device=mask.device), 1.0,
                          default_normalizer(self.aggregate, mask))

    def normalizer_for(self, rollouts: list[Rollout]) -> float:
        """The aggregator's denominator for this full batch (for your own micro-batching)."""
        return self.prepare(rollouts).normalizer

    def compute(self, tb: TrainBatch, normalizer: float | None = None) -> LossOutput:
        """`LossOutput(loss, metrics, token_logprobs)` of a prepared (micro-)batch: metrics the unit's (`sft_loss`),
        a `LazyMetrics` of tensors until read; token_logprobs (B, T), NaN where not trained."""
        if not self._dropout_checked:
            self._dropout_checked = warn_if_dropout(self.name, self.model)
        o = self.compute_options
        logp = token_logprobs(self.model, tb.batch, 1.0, o.chunk_size, positions=tb.mask,
                               share_prefix=o.share_prefix, head_impl=o.head_impl)
        out = sft_loss(logprobs=logp, mask=tb.mask, aggregate=self.aggregate,
                       normalizer=normalizer if normalizer is not None else tb.normalizer)
        full = torch.where(tb.mask.bool(), out.token_logprobs.float(), torch.nan)  # (B, T)
        self.metrics, self.token_logprobs = LazyMetrics.merged(out.metrics), full  # the record of this call
        return LossOutput(out.loss, self.metrics, full)

    def calculate_loss(self, rollouts, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over `rollouts`, or over a prepared `TrainBatch`."""
        tb = rollouts if isinstance(rollouts, TrainBatch) else self.prepare(rollouts)
        return self.compute(tb, normalizer).loss
