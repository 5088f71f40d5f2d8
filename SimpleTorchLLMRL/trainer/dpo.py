"""Direct preference optimization from pairs of rollouts that share a prompt.

Legend: P pairs, B = 2P rows, T tokens, N trained tokens. Rows come in pairs: row 2i is pair i's
chosen rollout, row 2i + 1 its rejected one (a micro-batch of an even number of rows holds whole pairs).

    dpo = DPO(model, tokenizer, ref_model=frozen_copy, beta=0.1)   # a peft model: no ref_model, adapter off
    loss = dpo.calculate_loss(chosen, rejected)                     # lists of P rollouts each

The variants of TRL's `DPOTrainer` ("sigmoid" DPO / cDPO, "robust" rDPO, "ipo" IPO), with their formulas and
sources: docs/losses.md, "DPO".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt
from SimpleTorchLLMRL.model.dropout import warn_if_dropout
from SimpleTorchLLMRL.model.scoring.logprobs import ComputeOptions
from SimpleTorchLLMRL.trainer import pipeline as P
from SimpleTorchLLMRL.trainer.losses import SUM, LazyMetrics, LossInputs, LossOutput, count, per_row
from SimpleTorchLLMRL.trainer.options import build_options, front_options

DPO_VARIANTS = ("sigmoid", "robust", "ipo")


@dataclass
class DPOConfig:
    """The options that change DPO's math; each is also a keyword argument of `DPO`."""

    beta: float = 0.1
    """The KL strength (the implicit reward's scale)."""
    variant: str = "sigmoid"
    """"sigmoid" (DPO; cDPO with label_smoothing), "robust" (rDPO) or "ipo" (IPO)."""
    label_smoothing: float = 0.0
    """The assumed fraction of flipped labels, in [0, 0.5) ("sigmoid": cDPO, "robust": rDPO; 0 for "ipo")."""

    def __post_init__(self):
        if self.variant not in DPO_VARIANTS:
            raise ValueError(f"DPO variant={self.variant!r} is invalid; expected one of {DPO_VARIANTS}")
        if not self.beta > 0:
            raise ValueError(f"DPO beta={self.beta!r} is invalid; expected > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"DPO label_smoothing={self.label_smoothing!r} is invalid; expected in [0, 0.5)")
        if self.variant == "ipo" and self.label_smoothing:
            raise ValueError("DPO variant='ipo' takes no label_smoothing (use 'sigmoid' or 'robust')")


def dpo_loss(inputs: LossInputs, config: DPOConfig) -> LossOutput:
    """The DPO loss of P pairs (rows 2i / 2i + 1: chosen / rejected), from logprobs and ref_logprobs (N,).

    normalizer: the FULL batch's pair count (None: this batch's P). Metrics, each a share of the full
    batch's mean over pairs (so micro-batches sum): loss, reward_accuracy (chosen reward > rejected
    reward), reward_margin, chosen_reward, rejected_reward (beta (log pi - log ref) of each side); num_sequences."""
    x, beta, e = inputs, config.beta, config.label_smoothing
    if x.rows % 2:
        raise ValueError(f"dpo_loss needs pairs of rows (chosen, rejected); got {x.rows} rows")
    n = per_row(torch.ones_like(x.logprobs), x.row, x.rows).clamp(min=1) if config.variant == "ipo" else 1.0

    def sequence(lp):  # (N,) -> (2P,) summed (IPO: averaged) over each row's trained tokens
        return per_row(lp, x.row, x.rows) / n

    policy, ref = sequence(x.logprobs), sequence(x.ref_logprobs.detach().to(x.logprobs.dtype))
    chosen, rejected = policy[0::2] - ref[0::2], policy[1::2] - ref[1::2]  # (P,) log-ratios to the reference
    h = chosen - rejected
    if config.variant == "sigmoid":
        per_pair = -(1 - e) * F.logsigmoid(beta * h) - e * F.logsigmoid(-beta * h)
    elif config.variant == "robust":
        per_pair = (-(1 - e) * F.logsigmoid(beta * h) + e * F.logsigmoid(-beta * h)) / (1 - 2 * e)
    else:
        per_pair = (h - 1 / (2 * beta)) ** 2
    pairs = max(float(h.shape[0] if x.normalizer is None else x.normalizer), 1.0)
    loss = per_pair.sum() / pairs
    c, r = (beta * chosen).detach(), (beta * rejected).detach()
    share = lambda v: (v.float().sum() / pairs, SUM)  # noqa: E731
    metrics = LazyMetrics.of(loss=(loss.detach(), SUM), reward_accuracy=share(c > r), reward_margin=share(c - r),
                             chosen_reward=share(c), rejected_reward=share(r), num_sequences=(count(x.rows, h), SUM))
    return LossOutput(loss, metrics, x.logprobs.detach())


def interleave(chosen: list[Rollout], rejected: list[Rollout], tokenizer) -> list[Rollout]:
    """[c0, r0, c1, r1, ...]; ValueError unless the lists pair up and each pair renders the same prompt ids
    (the messages before the first MODEL turn, with each rollout's tools and chat-template arguments)."""
    if len(chosen) != len(rejected) or not chosen:
        raise ValueError(f"DPO needs as many chosen as rejected rollouts (at least one); got {len(chosen)} and "
                         f"{len(rejected)}")
    out = []
    for i, (c, r) in enumerate(zip(chosen, rejected, strict=True)):
        prompt = lambda x: encode_prompt(Rollout(x.prompt_messages, x.metadata), tokenizer)  # noqa: E731
        if prompt(c) != prompt(r):
            raise ValueError(f"DPO pair {i}: the chosen and rejected rollouts have different prompts (the ids the "
                             "model sees before the first MODEL turn, tools and template arguments included); a "
                             "preference compares two replies to one prompt")
        out += [c, r]
    return out


@front_options(DPOConfig)
class DPO:
    """DPO over pairs of rollouts; `calculate_loss(chosen, rejected)` returns a scalar tensor.

    Options: `DPOConfig`'s and `ComputeOptions`', as GRPO's (`fused` has no effect here). ref_model: a
    frozen reference; None with a peft model: the same model with every adapter off (no second copy).
    Scored at temperature 1. `metrics` and `token_logprobs` record the last loss call."""

    name = "DPO"

    def __init__(self, model, tokenizer, config: DPOConfig | None = None, compute: ComputeOptions | None = None, *,
                 ref_model=None, **options):
        self.config, self.compute_options = build_options(type(self), config, compute, options)
        P.check_policy(self.name, model, tokenizer, ref_model, beta=1.0)  # a reference is always needed
        self.model, self.tokenizer, self.ref_model = model, tokenizer, ref_model
        self.metrics: dict = LazyMetrics()  # the last loss call's metrics (tensors until read)
        self.token_logprobs: torch.Tensor | None = None  # (2P, T) of the last loss call, NaN where not trained
        self._dropout_checked = False

    def prepare(self, chosen: list[Rollout], rejected: list[Rollout]) -> P.TrainBatch:
        """Encode the pairs (interleaved) and compute the reference's log-probs once."""
        tb = P.train_batch(self.name, self.model, self.tokenizer, interleave(chosen, rejected, self.tokenizer),
                           self.compute_options, normalizer=lambda m: m.shape[0] / 2, follow_sampling=False)
        tb.ref_logprobs = P.reference_logprobs(self.model, self.ref_model, tb, self.compute_options)
        return tb

    def compute(self, tb: P.TrainBatch, normalizer: float | None = None) -> LossOutput:
        """`LossOutput(loss, metrics, token_logprobs)` of a prepared (micro-)batch of whole pairs; token_logprobs
        (2P, T), NaN where not trained. normalizer: the FULL batch's pair count (a `split` keeps it)."""
        if len(tb) % 2:
            raise ValueError(f"a DPO micro-batch must hold whole pairs (an even number of rows); got {len(tb)}")
        if self.model.training and not self._dropout_checked:  # once, when it trains
            self._dropout_checked = warn_if_dropout(self.name, self.model)
        out = P.run_unit(dpo_loss, self.config, self.model, tb, self.compute_options, normalizer)
        self.metrics, self.token_logprobs = out.metrics, out.token_logprobs  # the record of this call
        return out

    def calculate_loss(self, chosen, rejected=None, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over lists of chosen and rejected rollouts (pair i: chosen[i], rejected[i]), or a prepared batch."""
        if isinstance(chosen, P.TrainBatch):
            return self.compute(chosen, normalizer).loss
        if rejected is None:
            raise ValueError("DPO.calculate_loss(chosen, rejected) needs the rejected rollouts")
        return self.compute(self.prepare(chosen, rejected), normalizer).loss
