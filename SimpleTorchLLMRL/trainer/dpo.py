"""Direct preference optimization from pairs of rollouts that share a prompt.

Legend: P pairs, B = 2P rows, T tokens (per-token tensors are (B, T), aligned with input_ids).
Rows come in pairs: row 2i is pair i's chosen rollout, row 2i + 1 its rejected one (so a
micro-batch of an even number of rows holds whole pairs).

    dpo = DPO(model, tokenizer, ref_model=frozen_copy, beta=0.1)   # a peft model: no ref_model, adapter off
    loss = dpo.calculate_loss(chosen, rejected)                     # lists of P rollouts each
    loss.backward(); optimizer.step(); optimizer.zero_grad()

With h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)), sequence log-probs summed over
the trained tokens, and e = label_smoothing:

    "sigmoid"  -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)       DPO (Rafailov et al. 2023);
                                                                            e > 0: conservative DPO (cDPO)
    "robust"   (-(1 - e) log sigmoid(beta h) + e log sigmoid(-beta h)) / (1 - 2e)   rDPO (Chowdhury et al. 2024)
    "ipo"      (h - 1 / (2 beta))^2, log-probs averaged over each sequence's tokens   IPO (Azar et al. 2023)

as TRL's `DPOTrainer` defines them (loss_type "sigmoid", "robust", "ipo").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs
from SimpleTorchLLMRL.trainer.batch import (
    TrainBatch,
    check_policy,
    encode,
    model_device,
    reference_logprobs,
    trained_mask,
    warn_if_dropout,
)
from SimpleTorchLLMRL.trainer.combine import LazyMetrics
from SimpleTorchLLMRL.trainer.losses import LossOutput
from SimpleTorchLLMRL.trainer.options import (
    UNSET,
    ComputeOptions,
    build_options,
    named_options,
    old_third_argument,
    one_of,
)

__all__ = ["DPO", "DPOConfig", "dpo_loss", "DPO_VARIANTS"]

DPO_VARIANTS = ("sigmoid", "robust", "ipo")


@dataclass
class DPOConfig:
    """beta: the KL strength (the implicit reward's scale); variant: "sigmoid" | "robust" | "ipo";
    label_smoothing: the assumed fraction of flipped labels, in [0, 0.5) ("sigmoid": cDPO,
    "robust": rDPO; 0 for "ipo")."""

    beta: float = 0.1
    variant: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self):
        if self.variant not in DPO_VARIANTS:
            raise ValueError(f"DPO variant={self.variant!r} is invalid; expected one of {DPO_VARIANTS}")
        if not self.beta > 0:
            raise ValueError(f"DPO beta={self.beta!r} is invalid; expected > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"DPO label_smoothing={self.label_smoothing!r} is invalid; expected in [0, 0.5)")
        if self.variant == "ipo" and self.label_smoothing:
            raise ValueError("DPO variant='ipo' takes no label_smoothing (use 'sigmoid' or 'robust')")


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """(B, T) per-token log-probs -> (B,) their sum over the trained tokens (mean with `mean`)."""
    m = mask.to(logprobs.dtype)
    s = (torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs)) * m).sum(-1)
    return s / m.sum(-1).clamp(min=1) if mean else s


def dpo_loss(*, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, beta: float = 0.1,
             variant: str = "sigmoid", label_smoothing: float = 0.0, normalizer: float | None = None) -> LossOutput:
    """The DPO loss of P pairs; rows 2i / 2i + 1 are pair i's chosen / rejected rollout.

    logprobs (2P, T) with grad, ref_logprobs (2P, T) the reference's (a constant), mask (2P, T) 1
    on trained tokens. normalizer: the FULL batch's pair count when micro-batching (default: P).
    Returns `LossOutput(loss, metrics, logprobs detached)`. Metrics, each a share of the full
    batch's mean over pairs (so micro-batches sum): loss, reward_accuracy (chosen reward >
    rejected reward), reward_margin, chosen_reward, rejected_reward (beta (log pi - log ref) of
    each side); num_sequences (rows).
    """
    cfg = DPOConfig(beta, variant, label_smoothing)  # checks the options
    if not (logprobs.shape == ref_logprobs.shape == mask.shape):
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)} and mask "
                         f"{tuple(mask.shape)} must have one shape (2P, T)")
    if logprobs.shape[0] % 2:
        raise ValueError(f"dpo_loss needs pairs of rows (chosen, rejected); got {logprobs.shape[0]} rows")
    mean = cfg.variant == "ipo"
    policy = sequence_logprobs(logprobs, mask, mean)  # (2P,)
    ref = sequence_logprobs(ref_logprobs.detach().to(policy.dtype), mask, mean)  # (2P,)
    chosen, rejected = policy[0::2] - ref[0::2], policy[1::2] - ref[1::2]  # (P,) log-ratios to the reference
    h = chosen - rejected  # (P,)
    e = cfg.label_smoothing
    if cfg.variant == "sigmoid":
        per_pair = -(1 - e) * F.logsigmoid(beta * h) - e * F.logsigmoid(-beta * h)
    elif cfg.variant == "robust":
        per_pair = (-(1 - e) * F.logsigmoid(beta * h) + e * F.logsigmoid(-beta * h)) / (1 - 2 * e)
    else:
        per_pair = (h - 1 / (2 * beta)) ** 2
    pairs = h.shape[0]
    n = float(pairs if normalizer is None else normalizer)
    loss = per_pair.sum() / max(n, 1.0)
    c, r = (beta * chosen).detach(), (beta * rejected).detach()
    share = lambda x: x.float().sum() / max(n, 1.0)  # noqa: E731
    metrics = {"loss": loss.detach(), "reward_accuracy": share(c > r), "reward_margin": share(c - r),
               "chosen_reward": share(c), "rejected_reward": share(r), "num_sequences": torch.full((), 2 * pairs, dtype=torch.long, device=mask.device)}
    return LossOutput(loss, metrics, logprobs.detach())


def interleave(chosen: list[Rollout], rejected: list[Rollout]) -> list[Rollout]:
    """[c0, r0, c1, r1, ...]; ValueError unless the lists pair up and each pair shares its prompt messages."""
    if len(chosen) != len(rejected) or not chosen:
        raise ValueError(f"DPO needs as many chosen as rejected rollouts (at least one); got {len(chosen)} and "
                         f"{len(rejected)}")
    out = []
    for i, (c, r) in enumerate(zip(chosen, rejected, strict=True)):
        key = lambda x: [(m.role, m.name, m.content) for m in x.prompt_messages]  # noqa: E731
        if key(c) != key(r):
            raise ValueError(f"DPO pair {i}: the chosen and rejected rollouts have different prompts (messages "
                             "before the first MODEL turn); a preference compares two replies to one prompt")
        out += [c, r]
    return out


_NOT_OPTIONS = frozenset({"self", "model", "tokenizer", "config", "compute", "ref_model", "positional"})


class DPO:
    """DPO over pairs of rollouts; `calculate_loss(chosen, rejected)` returns a scalar tensor.

    `DPO(model, tokenizer, config=None, compute=None, **options)`, as `GRPO`: options are `DPOConfig`'s (beta,
    variant, label_smoothing) and `ComputeOptions`' (chunk_size, head_impl, share_prefix, max_length, truncate;
    `fused` is accepted and has no effect), each a named keyword argument, plus ref_model; an unknown one raises
    `UnknownOptionError` (a TypeError). ref_model: a frozen reference; None with a peft model: the same model
    with every adapter off (`model.adapters.use_adapter(model, None)`, peft's `disable_adapter()`), no second
    copy. `DPO(model, tokenizer, ref_model)` (the reference as third positional argument) still works.
    `metrics` and `token_logprobs` record the last loss call.
    """

    name = "DPO"

    @named_options
    def __init__(self, model, tokenizer, config: DPOConfig | None = None, compute: ComputeOptions | None = None, *,
                 ref_model=UNSET, beta: float = UNSET, variant: str = UNSET, label_smoothing: float = UNSET,
                 chunk_size: int | None = UNSET, head_impl: str = UNSET, max_length: int | None = UNSET,
                 truncate: bool = UNSET, fused: bool | None = UNSET, share_prefix: bool = UNSET):
        """config: a `DPOConfig`, compute: `ComputeOptions`; each keyword overrides its field."""
        config, positional = old_third_argument(config, DPOConfig, lambda x: isinstance(x, nn.Module))
        ref_model = one_of(self.name, "ref_model", ref_model, positional)
        ref_model = None if ref_model is UNSET else ref_model
        given = {k: v for k, v in locals().items() if k not in _NOT_OPTIONS}
        self.config, self.compute_options = build_options(self.name, DPOConfig, config, compute, given)
        check_policy(self.name, model, tokenizer, ref_model, beta=1.0)  # a reference is always needed
        self.model, self.tokenizer, self.ref_model = model, tokenizer, ref_model
        self.metrics: dict = LazyMetrics()  # the last loss call's metrics (tensors until read)
        self.token_logprobs: torch.Tensor | None = None  # (2P, T) of the last loss call, NaN where not trained
        self._dropout_checked = False

    def _logprobs(self, model, batch, mask):
        o = self.compute_options
        return token_logprobs(model, batch, 1.0, o.chunk_size, positions=mask, share_prefix=o.share_prefix,
                              head_impl=o.head_impl)

    def prepare(self, chosen: list[Rollout], rejected: list[Rollout]) -> TrainBatch:
        """Encode the pairs (interleaved) and compute the reference's log-probs once."""
        o = self.compute_options
        batch = encode(self.name, interleave(chosen, rejected), self.tokenizer, model_device(self.model),
                       o.max_length, o.truncate)
        mask = trained_mask(batch)
        ref = reference_logprobs(self.model, self.ref_model, lambda m: self._logprobs(m, batch, mask))
        return TrainBatch(batch, mask, torch.zeros(len(batch), device=mask.device), 1.0, float(len(chosen)),
                          ref_logprobs=ref.to(mask.device))

    def compute(self, tb: TrainBatch, normalizer: float | None = None) -> LossOutput:
        """`LossOutput(loss, metrics, token_logprobs)` of a prepared (micro-)batch of whole pairs: metrics the
        unit's (`dpo_loss`), a `LazyMetrics` of tensors until read; token_logprobs (2P, T), NaN where not trained.

        normalizer: the FULL batch's pair count when micro-batching yourself (`split` keeps it)."""
        if len(tb) % 2:
            raise ValueError(f"a DPO micro-batch must hold whole pairs (an even number of rows); got {len(tb)}")
        if not self._dropout_checked:
            self._dropout_checked = warn_if_dropout(self.name, self.model)
        cfg = self.config
        logp = self._logprobs(self.model, tb.batch, tb.mask)
        out = dpo_loss(logprobs=logp, ref_logprobs=tb.ref_logprobs, mask=tb.mask, beta=cfg.beta, variant=cfg.variant,
                       label_smoothing=cfg.label_smoothing,
                       normalizer=normalizer if normalizer is not None else tb.normalizer)
        full = torch.where(tb.mask.bool(), out.token_logprobs.float(), torch.nan)  # (2P, T)
        self.metrics, self.token_logprobs = LazyMetrics.merged(out.metrics), full  # the record of this call
        return LossOutput(out.loss, self.metrics, full)

    def calculate_loss(self, chosen, rejected=None, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over lists of chosen and rejected rollouts (pair i: chosen[i], rejected[i]), or a prepared batch."""
        if isinstance(chosen, TrainBatch):
            return self.compute(chosen, normalizer).loss
        if rejected is None:
            raise ValueError("DPO.calculate_loss(chosen, rejected) needs the rejected rollouts")
        return self.compute(self.prepare(chosen, rejected), normalizer).loss
