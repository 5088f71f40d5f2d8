"""On-policy distillation over `Rollout`s: the student samples, a teacher scores, `calculate_loss` returns a tensor.

Legend: B rollouts, T tokens, N trained tokens, H hidden size. Per-token tensors are (B, T), aligned with input_ids.

    distill = Distill(student, tokenizer, teacher=teacher_model)        # or a vllm.LLM, or "rollouts"
    rollouts = collect_rollouts(ModelGenerate(student, tokenizer), env, questions, answers)
    loss = distill.calculate_loss(rollouts)                               # reverse KL to the teacher
    loss = distill.calculate_loss(rollouts, rewards)                      # ... plus a GRPO advantage
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Micro-batches and epochs, as with GRPO:

    prepared = distill.prepare(rollouts)              # encode; teacher log-probs once
    for mb in prepared.split(4):                      # each keeps the full batch's normalizer
        out = distill.compute(mb)                     # LossOutput(loss, metrics, token_logprobs)
        out.loss.backward()

A thin front over `trainer.teacher` (where the teacher's log-probs come from) and the pure
units of `trainer.distill_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.model.scoring.head import logit_softcap, output_head
from SimpleTorchLLMRL.model.scoring.hidden import final_hidden_states
from SimpleTorchLLMRL.model.scoring.logprobs import logprobs_from_hidden, scatter_positions, token_logprobs
from SimpleTorchLLMRL.model.scoring.shared_prefix import first_positions
from SimpleTorchLLMRL.trainer import advantages as A
from SimpleTorchLLMRL.trainer.batch import (
    TrainBatch,
    check_rewards,
    encode,
    model_device,
    resolve_temperature,
    trained_mask,
    warn_if_dropout,
)
from SimpleTorchLLMRL.trainer.combine import LazyMetrics
from SimpleTorchLLMRL.trainer.distill_loss import DIVERGENCES, distill_loss, jsd_loss
from SimpleTorchLLMRL.trainer.losses import (
    AGGREGATORS,
    Clip,
    LossOutput,
    aggregation_weights,
    default_normalizer,
)
from SimpleTorchLLMRL.trainer.options import (
    UNSET,
    ComputeOptions,
    build_options,
    named_options,
    old_third_argument,
    one_of,
)
from SimpleTorchLLMRL.trainer.teacher import (
    check_teacher_tokenizer,
    hf_teacher_logprobs,
    rollout_teacher_logprobs,
    vllm_teacher_logprobs,
)

__all__ = ["Distill", "DistillConfig", "DistillBatch"]

ROLLOUTS = "rollouts"  # teacher= for log-probs precomputed on the rollouts (trainer.teacher)


@dataclass
class DistillConfig:
    """The options that change the math; each is also a keyword argument of `Distill`.

    divergence: "reverse_kl" (the teacher's log-probs of the sampled tokens are enough; any
    teacher source) or "jsd" (GKD's generalized JSD over full distributions; an HF teacher with
    the student's vocabulary). kl_coef: the reverse KL advantage's weight. jsd_beta: 0 forward
    KL(teacher || student), 1 reverse KL, between the generalized JSD (TRL's convention).
    eps: None, the plain surrogate -A r; a float, PPO's clip [1 - eps, 1 + eps] (several epochs).
    aggregate: "token_mean" | "sequence_mean_token_mean" | "token_sum_constant" (`losses.AGGREGATORS`).
    temperature: None follows the rollouts' sampling temperature (1 when none is recorded).
    teacher_temperature: None, the student's; a vLLM teacher scores at 1 only.
    Rewards, when given: group-relative advantages (group_size / metadata["group_id"] / the prompt;
    scale_rewards as GRPO's) times rl_coef, added to the distillation advantage.
    """

    divergence: str = "reverse_kl"
    kl_coef: float = 1.0
    jsd_beta: float = 0.5
    eps: float | None = None
    aggregate: str = "token_mean"
    temperature: float | None = None
    teacher_temperature: float | None = None
    rl_coef: float = 1.0
    group_size: int | None = None
    scale_rewards: bool | str = True

    def __post_init__(self):
        def bad(name, allowed):
            raise ValueError(f"Distill {name}={getattr(self, name)!r} is invalid; expected {allowed}")

        if self.divergence not in DIVERGENCES:
            bad("divergence", f"one of {DIVERGENCES}")
        if self.aggregate not in AGGREGATORS:
            bad("aggregate", f"one of {sorted(AGGREGATORS)}")
        if self.scale_rewards not in (True, False, "group", "batch", "none"):
            bad("scale_rewards", "True, False, 'group', 'batch' or 'none'")
        for name, ok, allowed in [
            ("kl_coef", self.kl_coef >= 0, ">= 0"),
            ("jsd_beta", 0 <= self.jsd_beta <= 1, "in [0, 1]"),
            ("eps", self.eps is None or 0 < self.eps < 1, "None or in (0, 1)"),
            ("temperature", self.temperature is None or self.temperature > 0, "None or > 0"),
            ("teacher_temperature", self.teacher_temperature is None or self.teacher_temperature > 0, "None or > 0"),
            ("group_size", self.group_size is None or self.group_size >= 1, "None or an int >= 1"),
        ]:
            if not ok:
                bad(name, allowed)

    @property
    def clip(self) -> Clip | None:
        return None if self.eps is None else Clip(self.eps, self.eps)


@dataclass
class DistillBatch(TrainBatch):
    """A `TrainBatch` with the teacher's log-probs of the trained tokens, (B, T) (None for "jsd")."""

    teacher_logprobs: torch.Tensor | None = None

    def split(self, micro_batch_size: int) -> list[DistillBatch]:
        parts = super().split(micro_batch_size)
        for start, part in zip(range(0, len(self), micro_batch_size), parts, strict=True):
            if self.teacher_logprobs is not None:
                T = part.mask.shape[1]
                part.teacher_logprobs = self.teacher_logprobs[start: start + micro_batch_size, :T]
        return parts


_NOT_OPTIONS = frozenset({"self", "model", "tokenizer", "config", "compute", "teacher", "teacher_tokenizer",
                          "lora_request", "positional"})


class Distill:
    """On-policy distillation of `model` (the student) toward `teacher`.

    teacher: an HF causal LM (scored through the chunked head under `torch.no_grad`), a
    `vllm.LLM` (prompt log-probs, temperature 1), or "rollouts" (each rollout's
    `metadata["teacher_logprobs"]`, see `trainer.teacher`). teacher_tokenizer: the teacher's, when
    it is not the student's; refused unless it encodes the rollouts to the same ids with the same
    tokens (`trainer.teacher.check_teacher_tokenizer`).

    `Distill(model, tokenizer, config=None, compute=None, **options)`, as `GRPO`: options are `DistillConfig`'s
    and `ComputeOptions`' (chunk_size, head_impl, share_prefix, max_length, truncate; `fused` is accepted and
    has no effect here), each a named keyword argument, plus teacher, teacher_tokenizer and lora_request; an
    unknown one raises `UnknownOptionError` (a TypeError). `Distill(model, tokenizer, teacher)` (the teacher as
    third positional argument, anything but a `DistillConfig`) still works. `metrics` and `token_logprobs`
    record the last loss call.
    """

    name = "Distill"

    @named_options
    def __init__(self, model, tokenizer, config: DistillConfig | None = None, compute: ComputeOptions | None = None,
                 *, teacher=UNSET, teacher_tokenizer=None, lora_request=None,
                 divergence: str = UNSET, kl_coef: float = UNSET, jsd_beta: float = UNSET, eps: float | None = UNSET,
                 aggregate: str = UNSET, temperature: float | None = UNSET, teacher_temperature: float | None = UNSET,
                 rl_coef: float = UNSET, group_size: int | None = UNSET, scale_rewards: bool | str = UNSET,
                 chunk_size: int | None = UNSET, head_impl: str = UNSET, max_length: int | None = UNSET,
                 truncate: bool = UNSET, fused: bool | None = UNSET, share_prefix: bool = UNSET):
        """config: a `DistillConfig`, compute: `ComputeOptions`; each keyword overrides its field.
        teacher: an HF model, a `vllm.LLM` or "rollouts" (the default)."""
        config, positional = old_third_argument(config, DistillConfig, lambda x: True)
        teacher = one_of(self.name, "teacher", teacher, positional)
        teacher = ROLLOUTS if teacher is UNSET else teacher
        given = {k: v for k, v in locals().items() if k not in _NOT_OPTIONS}
        self.config, self.compute_options = build_options(self.name, DistillConfig, config, compute, given)
        if teacher is model:
            raise ValueError("Distill: the teacher is the student itself (the KL is always 0); pass another model")
        self.kind = "rollouts" if isinstance(teacher, str) and teacher == ROLLOUTS else (
            "hf" if isinstance(teacher, nn.Module) else "vllm" if hasattr(teacher, "generate") else None)
        if self.kind is None:
            raise ValueError(f"Distill teacher={teacher!r:.60} is invalid; expected an HF model, a vllm.LLM or "
                             f"{ROLLOUTS!r} (log-probs precomputed in metadata['teacher_logprobs'])")
        if self.config.divergence == "jsd" and self.kind != "hf":
            raise ValueError(f"Distill divergence='jsd' needs the teacher's full distribution: an HF teacher, not "
                             f"{self.kind!r} (which gives log-probs of the sampled tokens only; use 'reverse_kl')")
        if self.kind == "vllm" and self.config.teacher_temperature not in (None, 1.0):
            raise ValueError("Distill: a vLLM teacher's prompt log-probs are at temperature 1; "
                             f"teacher_temperature={self.config.teacher_temperature} cannot be honoured")
        if self.kind == "vllm" and teacher_tokenizer is None and hasattr(teacher, "get_tokenizer"):
            teacher_tokenizer = teacher.get_tokenizer()
        self.model, self.tokenizer, self.teacher = model, tokenizer, teacher
        self.teacher_tokenizer, self.lora_request = teacher_tokenizer, lora_request
        self.metrics: dict = LazyMetrics()  # the last loss call's metrics (tensors until read)
        self.token_logprobs: torch.Tensor | None = None  # (B, T) of the last loss call, NaN where not trained
        self._dropout_checked = False

    # -- rollouts -> a prepared batch

    def group_index(self, rollouts: list[Rollout]) -> torch.Tensor:
        """(B,) long: group_size blocks, else metadata["group_id"], else identical prompt messages."""
        return A.rollout_groups(rollouts, self.config.group_size)

    def teacher_logprobs(self, rollouts: list[Rollout], batch, mask: torch.Tensor, temperature: float):
        """(B, T) the teacher's log-probs of the trained tokens, from whichever source `teacher` is."""
        o = self.compute_options
        if self.kind == "rollouts":
            return rollout_teacher_logprobs(rollouts, batch, mask)
        check_teacher_tokenizer(self.tokenizer, self.teacher_tokenizer, rollouts, batch, o.max_length, o.truncate)
        if self.kind == "vllm":
            if abs(temperature - 1.0) > 1e-6:
                raise ValueError(f"Distill: the rollouts were sampled at temperature {temperature} but a vLLM teacher "
                                 "scores at temperature 1; sample at 1 or use an HF teacher")
            return vllm_teacher_logprobs(self.teacher, batch, mask, lora_request=self.lora_request)
        return hf_teacher_logprobs(self.teacher, batch, mask, temperature=temperature, chunk_size=o.chunk_size,
                                   head_impl=o.head_impl, tokenizer=self.teacher_tokenizer or self.tokenizer)

    def prepare(self, rollouts: list[Rollout], rewards=None, compute_old: bool = True) -> DistillBatch:
        """Encode; the teacher's log-probs (reverse KL) once; old log-probs; RL advantages when rewards are given.

        compute_old: recompute (no grad) the student's log-probs where the rollouts carry no sampled
        ones, so several epochs share one old policy; False: those tokens are on-policy (ratio 1)."""
        cfg, o = self.config, self.compute_options
        batch = encode(self.name, rollouts, self.tokenizer, model_device(self.model), o.max_length, o.truncate)
        mask = trained_mask(batch)
        temperature = resolve_temperature(self.name, cfg.temperature, batch.sampling_temperature)
        teacher_t = cfg.teacher_temperature or temperature
        teacher = None if cfg.divergence == "jsd" else self.teacher_logprobs(rollouts, batch, mask, teacher_t)
        if cfg.divergence == "jsd" and self.teacher_tokenizer is not None:
            check_teacher_tokenizer(self.tokenizer, self.teacher_tokenizer, rollouts, batch, o.max_length, o.truncate)
        sampled = batch.sampler_logprobs
        old = None
        missing = sampled is None or bool(torch.isnan(sampled[mask.bool()]).any())
        if compute_old and missing:
            with torch.no_grad():
                old = token_logprobs(self.model, batch, temperature, o.chunk_size, positions=mask,
                                     share_prefix=o.share_prefix, head_impl=o.head_impl, truncation=batch.truncation)
        if sampled is not None:  # the sampler's log-probs are the old policy where known
            old = torch.where(torch.isnan(sampled), old if old is not None else torch.nan, sampled)
        metrics: dict = {"temperature": temperature}
        adv = None
        if rewards is not None:
            if cfg.divergence == "jsd":
                raise ValueError("Distill divergence='jsd' takes no rewards; use divergence='reverse_kl' to add an "
                                 "RL advantage")
            r = check_rewards(rewards, len(rollouts))
            adv = cfg.rl_coef * A.group_relative_advantages(r, self.group_index(rollouts), cfg.scale_rewards)
            metrics.update(reward_mean=r.mean().item(), rl_advantage_abs_mean=adv.abs().mean().item())
            adv = adv.to(batch.input_ids.device)
        else:
            r = torch.zeros(len(rollouts))
        norm = default_normalizer(cfg.aggregate, mask)
        return DistillBatch(batch, mask, r.to(batch.input_ids.device), temperature, norm, advantages=adv,
                            old_logprobs=old, metrics=metrics, teacher_logprobs=teacher)

    # -- the loss

    def compute(self, db: DistillBatch, normalizer: float | None = None) -> LossOutput:
        """`LossOutput(loss, metrics, token_logprobs)` of a prepared (micro-)batch: metrics the unit's
        (`distill_loss` / `jsd_loss`) with the batch's, a `LazyMetrics` of tensors until read; token_logprobs
        the student's recomputed log-probs (B, T), NaN where not trained.

        normalizer: the FULL batch's denominator when you micro-batch yourself (`split` keeps it)."""
        cfg, o, mask, batch = self.config, self.compute_options, db.mask, db.batch
        if not self._dropout_checked:
            self._dropout_checked = warn_if_dropout(self.name, self.model)
        norm = normalizer if normalizer is not None else db.normalizer
        start = first_positions(mask) if o.share_prefix else None  # (B,) first hidden state a row needs
        hidden = final_hidden_states(self.model, batch.input_ids, batch.attention_mask, start=start)  # (B, T, H)
        select = mask[:, 1:].bool()  # (B, T-1): token t+1 is trained, predicted from position t
        h, y = hidden[:, :-1][select], batch.input_ids[:, 1:][select]  # (N, H), (N,)
        head, softcap = output_head(self.model), logit_softcap(self.model)
        if cfg.divergence == "jsd":
            out, entropy = self._jsd(db, select, h, y, norm), None
            lp = out.logprobs
        else:
            trunc = None if batch.truncation is None else batch.truncation.map(lambda t: t[:, 1:][select])
            lp, entropy = logprobs_from_hidden(h, head, y, temperature=db.temperature, chunk_size=o.chunk_size,
                                               softcap=softcap, head_impl=o.head_impl, truncation=trunc)  # (N,)
            logp = scatter_positions(lp, select)  # (B, T)
            old = db.old_logprobs
            if old is not None:
                old = torch.where(torch.isnan(old), logp.detach(), old)
            out = distill_loss(logprobs=logp, teacher_logprobs=db.teacher_logprobs, mask=mask, old_logprobs=old,
                               advantages=db.advantages, kl_coef=cfg.kl_coef, clip=cfg.clip, aggregate=cfg.aggregate,
                               normalizer=norm)
            lp = lp.detach()
        full = torch.full(mask.shape, torch.nan, device=lp.device)  # (B, T)
        full[:, 1:][select] = lp.float()
        extra = {"num_sequences": torch.full((), len(db), dtype=torch.long, device=mask.device)}
        if entropy is not None and entropy.numel():
            extra["entropy"] = entropy.float().mean()
        metrics = LazyMetrics.merged(db.metrics, out.metrics, extra)  # tensors until read
        self.metrics, self.token_logprobs = metrics, full  # the record of this call
        return LossOutput(out.loss, metrics, full)

    def _jsd(self, db: DistillBatch, select, h, y, norm):
        cfg, o = self.config, self.compute_options
        teacher_device = next(self.teacher.parameters()).device
        with torch.no_grad():
            th = final_hidden_states(self.teacher, db.batch.input_ids.to(teacher_device),
                                     db.batch.attention_mask.to(teacher_device))  # (B, T, H')
            th = th[:, :-1][select.to(teacher_device)]  # (N, H')
        weight = aggregation_weights(cfg.aggregate, db.mask, norm)[:, 1:][select]  # (N,)
        return jsd_loss(hidden=h, head=output_head(self.model), teacher_hidden=th,
                        teacher_head=_OnDevice(output_head(self.teacher), h.device), targets=y, weight=weight,
                        beta=cfg.jsd_beta, temperature=db.temperature,
                        chunk_size=o.chunk_size or 512, softcap=logit_softcap(self.model),
                        teacher_softcap=logit_softcap(self.teacher))

    def calculate_loss(self, rollouts, rewards=None, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over `rollouts` (and their (B,) rewards, if any), or over a prepared `DistillBatch`."""
        if isinstance(rollouts, DistillBatch):
            if rewards is not None:
                raise ValueError("calculate_loss(prepared_batch) takes no rewards: they are in the prepared batch")
            return self.compute(rollouts, normalizer).loss
        return self.compute(self.prepare(rollouts, rewards, compute_old=False), normalizer).loss


class _OnDevice(nn.Module):
    """The teacher's head on the teacher's device, its logits moved to the student's (`device`)."""

    def __init__(self, head: nn.Module, device: torch.device):
        super().__init__()
        self.head, self.device = head, device

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h).to(self.device)
