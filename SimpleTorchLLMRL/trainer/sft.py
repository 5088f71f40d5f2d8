"""Supervised fine-tuning from rollouts: cross-entropy on the trainable tokens, through the chunked head.

Legend: B rollouts, T tokens, N trained tokens.

    sft = SFT(model, tokenizer)
    loss = sft.calculate_loss(demonstrations)         # mean NLL of the trainable tokens
    loss = grpo.calculate_loss(rollouts, rewards) + 0.1 * sft.calculate_loss(demonstrations)   # mixed

The trained tokens are exactly `encode_rollout`'s loss mask (trainable MODEL turns; a hand-written
reply covers its content and end-of-turn token), so SFT sees the encoding RL uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.model.dropout import warn_if_dropout
from SimpleTorchLLMRL.model.scoring.head import check_vocabulary
from SimpleTorchLLMRL.model.scoring.logprobs import ComputeOptions
from SimpleTorchLLMRL.trainer import losses as L
from SimpleTorchLLMRL.trainer import pipeline as P
from SimpleTorchLLMRL.trainer.options import build_options, front_options


@dataclass
class SFTConfig:
    """The option that changes SFT's math; also a keyword argument of `SFT`."""

    aggregate: str = "token_mean"
    """How the per-token NLL is weighted: "token_mean" | "sequence_mean_token_mean" | "token_sum_constant"."""

    def __post_init__(self):
        L.check_aggregate(self.aggregate, "SFT")


def sft_loss(inputs: L.LossInputs, config: SFTConfig) -> L.LossOutput:
    """Cross-entropy -sum_t w_t log p(y_t) of the trained tokens (the aggregate's weights w); metrics loss,
    nll (token mean), num_tokens, num_sequences."""
    lp = inputs.logprobs
    loss = -(lp * L.weights(config.aggregate, inputs).to(lp.dtype)).sum()
    metrics = L.LazyMetrics.of(loss=(loss.detach(), L.SUM), nll=(-lp.detach().float().mean(), L.TOKEN_MEAN),
                             num_tokens=(L.count(inputs.num_tokens, lp), L.SUM), num_sequences=(L.count(inputs.rows, lp), L.SUM))
    return L.LossOutput(loss, metrics, lp.detach())


@front_options(SFTConfig)
class SFT:
    """Cross-entropy on the trainable tokens of `Rollout`s; `calculate_loss(rollouts)` returns a scalar tensor.

    Options: `SFTConfig`'s and `ComputeOptions`', as GRPO's (`fused` has no effect here). Scored at
    temperature 1 (the data's likelihood). `metrics` and `token_logprobs` record the last loss call."""

    name = "SFT"

    def __init__(self, model, tokenizer, config: SFTConfig | None = None, compute: ComputeOptions | None = None,
                 **options):
        self.config, self.compute_options = build_options(type(self), config, compute, options)
        check_vocabulary(model, tokenizer)
        self.model, self.tokenizer = model, tokenizer
        self.metrics: dict = L.LazyMetrics()  # the last loss call's metrics (tensors until read)
        self.token_logprobs: torch.Tensor | None = None  # (B, T) of the last loss call, NaN where not trained
        self._dropout_checked = False

    def prepare(self, rollouts: list[Rollout]) -> P.TrainBatch:
        """Encode once (micro-batches via `.split(n)` keep the full batch's normalizer)."""
        return P.train_batch(self.name, self.model, self.tokenizer, rollouts, self.compute_options,
                             normalizer=lambda m: L.normalizer(self.config.aggregate, m), follow_sampling=False)

    def compute(self, tb: P.TrainBatch, normalizer: float | None = None) -> L.LossOutput:
        """`LossOutput(loss, metrics, token_logprobs)` of a prepared (micro-)batch; token_logprobs (B, T), NaN where
        not trained."""
        if self.model.training and not self._dropout_checked:  # once, when it trains
            self._dropout_checked = warn_if_dropout(self.name, self.model)
        out = P.run_unit(sft_loss, self.config, self.model, tb, self.compute_options, normalizer)
        self.metrics, self.token_logprobs = out.metrics, out.token_logprobs  # the record of this call
        return out

    def calculate_loss(self, rollouts, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over `rollouts`, or over a prepared `TrainBatch`."""
        tb = rollouts if isinstance(rollouts, P.TrainBatch) else self.prepare(rollouts)
        return self.compute(tb, normalizer).loss
