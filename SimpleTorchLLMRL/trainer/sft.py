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

from dataclasses import fields

import torch

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.model.scoring.head import check_vocabulary
from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs
from SimpleTorchLLMRL.trainer.batch import (
    ComputeOptions,
    StepOutput,
    TrainBatch,
    encode,
    model_device,
    trained_mask,
    warn_if_dropout,
)
from SimpleTorchLLMRL.trainer.grpo_loss import LossOutput
from SimpleTorchLLMRL.trainer.losses import AGGREGATORS, aggregation_weights, default_normalizer

__all__ = ["SFT", "sft_loss"]


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
               "num_sequences": torch.tensor(m.shape[0])}
    return LossOutput(loss, metrics, logprobs.detach())


class SFT:
    """Cross-entropy on the trainable tokens of `Rollout`s; `calculate_loss(rollouts)` returns a scalar tensor.

    aggregate: "token_mean" (default) | "sequence_mean_token_mean" | "token_sum_constant".
    compute / overrides: `ComputeOptions` (chunk_size, head_impl, share_prefix, max_length, truncate).
    """

    name = "SFT"

    def __init__(self, model, tokenizer, aggregate: str = "token_mean", compute: ComputeOptions | None = None,
                 **overrides):
        if aggregate not in AGGREGATORS:
            raise ValueError(f"SFT aggregate={aggregate!r} is invalid; expected one of {sorted(AGGREGATORS)}")
        allowed = {f.name for f in fields(ComputeOptions)}
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise ValueError(f"SFT got unknown options {unknown}; allowed: {sorted(allowed | {'aggregate'})}")
        base = {f.name: getattr(compute, f.name) for f in fields(ComputeOptions)} if compute else {}
        self.compute_options = ComputeOptions(**{**base, **overrides})
        check_vocabulary(model, tokenizer)
        self.model, self.tokenizer, self.aggregate = model, tokenizer, aggregate
        self.metrics: dict = {}
        self._dropout_checked = False

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

    def compute(self, tb: TrainBatch, normalizer: float | None = None) -> StepOutput:
        """Loss, metrics and log-probs ((B, T), NaN where not trained) of a prepared (micro-)batch."""
        if not self._dropout_checked:
            self._dropout_checked = warn_if_dropout(self.name, self.model)
        o = self.compute_options
        logp = token_logprobs(self.model, tb.batch, 1.0, o.chunk_size, positions=tb.mask,
                               share_prefix=o.share_prefix, head_impl=o.head_impl)
        out = sft_loss(logprobs=logp, mask=tb.mask, aggregate=self.aggregate,
                       normalizer=normalizer if normalizer is not None else tb.normalizer)
        full = torch.where(tb.mask.bool(), out.logprobs.float(), torch.nan)
        self.metrics = dict(out.metrics)
        return StepOutput(out.loss, self.metrics, full)

    def calculate_loss(self, rollouts, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over `rollouts`, or over a prepared `TrainBatch`."""
        tb = rollouts if isinstance(rollouts, TrainBatch) else self.prepare(rollouts)
        return self.compute(tb, normalizer).loss
