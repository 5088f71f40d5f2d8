"""On-policy distillation: the student samples, a teacher scores; two loss units and their front.

Legend: B rollouts, T tokens, N trained tokens, n of a chunk, H hidden size, V vocab.

    distill = Distill(student, tokenizer, teacher=teacher_model)     # or a vllm.LLM, or "rollouts"
    loss = distill.calculate_loss(rollouts)                           # reverse KL to the teacher
    loss = distill.calculate_loss(rollouts, rewards)                  # ... plus a GRPO advantage

`distill_loss`: the reverse KL as a constant advantage in the policy-gradient loss (GKD); `jsd_loss`: GKD's
generalized JSD over full distributions, chunk by chunk, never (B, T, V). The math and the test of its
gradient: docs/losses.md, "Distillation"; where the teacher's log-probs come from: `trainer.teacher`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.model.dropout import warn_if_dropout
from SimpleTorchLLMRL.model.scoring.head import (
    final_hidden_states,
    logit_softcap,
    model_vocab_size,
    output_head,
)
from SimpleTorchLLMRL.model.scoring.logprobs import ComputeOptions, hidden_states, scatter_index
from SimpleTorchLLMRL.trainer import losses as L
from SimpleTorchLLMRL.trainer import pipeline as P
from SimpleTorchLLMRL.trainer import teacher as source
from SimpleTorchLLMRL.trainer.grpo import group_relative_advantages
from SimpleTorchLLMRL.trainer.options import build_options, front_options

DIVERGENCES = ("reverse_kl", "jsd")
ROLLOUTS = "rollouts"  # teacher= for log-probs precomputed on the rollouts (trainer.teacher)


@dataclass
class DistillConfig:
    """The options that change distillation's math; each is also a keyword argument of `Distill`."""

    divergence: str = "reverse_kl"
    """"reverse_kl" (the teacher's log-probs of the sampled tokens suffice; any teacher source) or "jsd"
    (GKD's generalized JSD over full distributions; an HF teacher with the student's vocabulary)."""
    kl_coef: float = 1.0
    """Weight of the reverse-KL advantage."""
    jsd_beta: float = 0.5
    """The JSD's interpolation: 0 forward KL(teacher || student), 1 reverse KL (TRL's convention)."""
    eps: float | None = None
    """None: the plain surrogate -A r; a float: PPO's clip [1 - eps, 1 + eps] (several epochs)."""
    aggregate: str = "token_mean"
    """How per-token losses are weighted: "token_mean" | "sequence_mean_token_mean" | "token_sum_constant"."""
    temperature: float | None = None
    """None follows the rollouts' sampling temperature (1.0 when none is recorded)."""
    teacher_temperature: float | None = None
    """The teacher's scoring temperature (None: the student's); a vLLM teacher scores at 1 only."""
    rl_coef: float = 1.0
    """Weight of the group-relative RL advantage added when rewards are given."""
    group_size: int | None = None
    """Groups of the RL advantage, as GRPO's (None: metadata["group_id"], else identical prompts)."""
    scale_rewards: bool | str = True
    """Scaling of the RL advantage, as GRPO's."""

    def __post_init__(self):
        for name, ok, allowed in [
            ("divergence", self.divergence in DIVERGENCES, f"one of {DIVERGENCES}"),
            ("aggregate", self.aggregate in L.AGGREGATES, f"one of {L.AGGREGATES}"),
            ("scale_rewards", self.scale_rewards in (True, False, "group", "batch", "none"),
             "True, False, 'group', 'batch' or 'none'"),
            ("kl_coef", self.kl_coef >= 0, ">= 0"), ("jsd_beta", 0 <= self.jsd_beta <= 1, "in [0, 1]"),
            ("eps", self.eps is None or 0 < self.eps < 1, "None or in (0, 1)"),
            ("temperature", self.temperature is None or self.temperature > 0, "None or > 0"),
            ("teacher_temperature", self.teacher_temperature is None or self.teacher_temperature > 0, "None or > 0"),
            ("group_size", self.group_size is None or self.group_size >= 1, "None or an int >= 1"),
        ]:
            if not ok:
                raise ValueError(f"Distill {name}={getattr(self, name)!r} is invalid; expected {allowed}")

    clip = property(lambda self: None if self.eps is None else L.Clip(self.eps, self.eps))


def distill_loss(inputs: L.LossInputs, config: DistillConfig) -> L.LossOutput:
    """The reverse-KL-as-advantage policy-gradient loss of the trained tokens: the constant
    A_t = -kl_coef (log p_student(y_t) - log p_teacher(y_t)) (+ an RL advantage) in -A_t r_t (or PPO-clipped).

    Reads logprobs, teacher_logprobs, old / sampler log-probs (the sampling policy: the ratio's
    denominator and the student term of the advantage), advantages (an RL advantage, added)."""
    x, lp = inputs, inputs.logprobs
    if bool(torch.isnan(x.teacher_logprobs).any()):
        raise ValueError("teacher_logprobs is NaN on a trained token: every trained token needs a teacher score")
    old, _ = L.old_logprobs(lp, x.old_logprobs, x.sampler_logprobs)
    teacher = x.teacher_logprobs.to(lp.dtype)
    adv = -config.kl_coef * (old - teacher)
    if x.advantages is not None:
        adv = adv + x.advantages.to(lp.dtype)
    log_ratio = lp - old
    if config.clip is None:
        per_token, clipped = -adv * torch.exp(log_ratio), None
    else:
        per_token, flags = L.clipped_surrogate(log_ratio, lp, adv, config.clip)
        clipped = flags["clipped_low"] | flags["clipped_high"]
    loss = (per_token * L.weights(config.aggregate, x)).sum()
    ratio = torch.exp(log_ratio.detach())
    mean = lambda t: (t.detach().float().mean(), L.TOKEN_MEAN)  # noqa: E731
    metrics = dict(loss=(loss.detach(), L.SUM), reverse_kl=mean(old - teacher), advantage_mean=mean(adv),
                   ratio_mean=mean(ratio), ratio_min=(ratio.min().float(), L.MIN), ratio_max=(ratio.max().float(), L.MAX),
                   num_tokens=(L.count(x.num_tokens, lp), L.SUM), num_sequences=(L.count(x.rows, lp), L.SUM))
    if clipped is not None:
        metrics["clip_frac"] = mean(clipped)
    if x.entropy is not None:
        metrics["entropy"] = mean(x.entropy)
    return L.LossOutput(loss, L.LazyMetrics.of(**metrics), lp.detach())


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """(n, V) logits -> (n,) GKD's generalized JSD, TRL's `beta`: beta KL(teacher || M) + (1 - beta) KL(student || M),
    M = beta teacher + (1 - beta) student; beta 0 is KL(teacher || student), 1 KL(student || teacher)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must be in [0, 1], got {beta}")
    s, t = torch.log_softmax(student_logits, dim=-1), torch.log_softmax(teacher_logits, dim=-1)
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1)
    mix = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), dim=0)  # log M, (n, V)
    return beta * (t.exp() * (t - mix)).sum(-1) + (1 - beta) * (s.exp() * (s - mix)).sum(-1)


def _logits(head, h: torch.Tensor, softcap: float | None, inv_temp: float) -> torch.Tensor:
    z = head(h).float()  # (n, V)
    return (softcap * torch.tanh(z / softcap) if softcap else z) * inv_temp


def jsd_loss(inputs: L.LossInputs, config: DistillConfig) -> L.LossOutput:
    """sum_i w_i JSD_beta(student_i, teacher_i) over the N trained tokens, chunked; `LossOutput(..., logp (N,))`.

    inputs.extra: "hidden" (N, H) the student's final hidden states that predict "targets" (N,) through
    "head"; "teacher_hidden" (N, H') the teacher's (no gradient flows into them) through "teacher_head"
    (both heads score one vocabulary); "softcap" / "teacher_softcap"; "chunk_size" tokens per chunk, each
    chunk's logits built under `torch.utils.checkpoint` (backward recomputes one chunk at a time)."""
    e, inv_temp = inputs.extra, 1.0 / inputs.temperature
    hidden, targets, teacher_hidden = e["hidden"], e["targets"], e["teacher_hidden"].detach()
    n, size = hidden.shape[0], e.get("chunk_size") or 512
    if teacher_hidden.shape[0] != n or targets.shape != (n,):
        raise ValueError(f"jsd_loss: hidden {tuple(hidden.shape)}, teacher_hidden {tuple(teacher_hidden.shape)} and "
                         f"targets {tuple(targets.shape)} must agree on N")

    def chunk(h, ht, y):
        zs = _logits(e["head"], h, e.get("softcap"), inv_temp)  # (n, V)
        with torch.no_grad():
            zt = _logits(e["teacher_head"], ht, e.get("teacher_softcap"), inv_temp)  # (n, V), a constant
        if zs.shape[-1] != zt.shape[-1]:
            raise ValueError(f"jsd needs one vocabulary: the student scores {zs.shape[-1]} ids, the teacher "
                             f"{zt.shape[-1]}; use the reverse-KL loss (log-probs of the sampled tokens only)")
        return generalized_jsd(zs, zt, config.jsd_beta), zs.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(zs, -1)

    parts = [checkpoint(chunk, hidden[s:s + size], teacher_hidden[s:s + size], targets[s:s + size],
                        use_reentrant=False) if torch.is_grad_enabled()
             else chunk(hidden[s:s + size], teacher_hidden[s:s + size], targets[s:s + size]) for s in range(0, n, size)]
    div = torch.cat([d for d, _ in parts]) if parts else hidden.new_zeros(0, dtype=torch.float32)  # (N,)
    logp = torch.cat([lp.detach() for _, lp in parts]) if parts else div.detach()
    loss = (div * L.weights(config.aggregate, inputs).to(div.dtype)).sum()
    metrics = L.LazyMetrics.of(loss=(loss.detach(), L.SUM), jsd=(div.detach().mean() if n else div.new_zeros(()), L.TOKEN_MEAN),
                             num_tokens=(L.count(n, div), L.SUM), num_sequences=(L.count(inputs.rows, div), L.SUM))
    return L.LossOutput(loss, metrics, logp)


@front_options(DistillConfig)
class Distill:
    """On-policy distillation of `model` (the student) toward `teacher`.

    teacher: an HF causal LM (scored through the chunked head under `torch.no_grad`), a `vllm.LLM` (prompt
    log-probs, temperature 1), or "rollouts" (the default: each rollout's `metadata["teacher_logprobs"]`,
    `trainer.teacher`). teacher_tokenizer: the teacher's when it is not the student's; refused unless it
    encodes the rollouts to the same ids with the same tokens. lora_request: the vLLM teacher's adapter.
    Options: `DistillConfig`'s and `ComputeOptions`', as GRPO's."""

    name = "Distill"

    def __init__(self, model, tokenizer, config: DistillConfig | None = None, compute: ComputeOptions | None = None,
                 *, teacher=ROLLOUTS, teacher_tokenizer=None, lora_request=None, **options):
        self.config, self.compute_options = build_options(type(self), config, compute, options)
        if teacher is model:
            raise ValueError("Distill: the teacher is the student itself (the KL is always 0); pass another model")
        self.kind = "rollouts" if isinstance(teacher, str) and teacher == ROLLOUTS else (
            "hf" if isinstance(teacher, nn.Module) else "vllm" if hasattr(teacher, "generate") else None)
        if self.kind is None:
            raise ValueError(f"Distill teacher={teacher!r:.60} is invalid; expected an HF model, a vllm.LLM or "
                             f"{ROLLOUTS!r} (log-probs precomputed in metadata['teacher_logprobs'])")
        if self.config.divergence == "jsd":
            if self.kind != "hf":
                raise ValueError(f"Distill divergence='jsd' needs the teacher's full distribution: an HF teacher, not "
                                 f"{self.kind!r} (which gives log-probs of the sampled tokens only; use 'reverse_kl')")
            if model_vocab_size(teacher) != model_vocab_size(model):
                raise ValueError(f"Distill divergence='jsd' needs one vocabulary: the student scores "
                                 f"{model_vocab_size(model)} ids, the teacher {model_vocab_size(teacher)}; use "
                                 "divergence='reverse_kl' (log-probs of the sampled tokens only)")
        if self.kind == "vllm" and self.config.teacher_temperature not in (None, 1.0):
            raise ValueError("Distill: a vLLM teacher's prompt log-probs are at temperature 1; "
                             f"teacher_temperature={self.config.teacher_temperature} cannot be honoured")
        if self.kind == "vllm" and teacher_tokenizer is None and hasattr(teacher, "get_tokenizer"):
            teacher_tokenizer = teacher.get_tokenizer()
        self.model, self.tokenizer, self.teacher = model, tokenizer, teacher
        self.teacher_tokenizer, self.lora_request = teacher_tokenizer, lora_request
        self.metrics: dict = L.LazyMetrics()  # the last loss call's metrics (tensors until read)
        self.token_logprobs: torch.Tensor | None = None  # (B, T) of the last loss call, NaN where not trained
        self._dropout_checked = False

    def teacher_logprobs(self, rollouts: list[Rollout], tb: P.TrainBatch, temperature: float) -> torch.Tensor:
        """(B, T) the teacher's log-probs of the trained tokens, from whichever source `teacher` is."""
        o, batch, mask = self.compute_options, tb.batch, tb.mask
        if self.kind == "rollouts":
            return source.rollout_teacher_logprobs(rollouts, batch, mask)
        if self.kind == "vllm":
            if abs(temperature - 1.0) > 1e-6:
                raise ValueError(f"Distill: the rollouts were sampled at temperature {temperature} but a vLLM teacher "
                                 "scores at temperature 1; sample at 1 or use an HF teacher")
            return source.vllm_teacher_logprobs(self.teacher, batch, mask, lora_request=self.lora_request)
        return source.hf_teacher_logprobs(self.teacher, batch, mask, temperature=temperature, chunk_size=o.chunk_size,
                                          head_impl=o.head_impl, tokenizer=self.teacher_tokenizer or self.tokenizer)

    def prepare(self, rollouts: list[Rollout], rewards=None, compute_old: bool = True) -> P.TrainBatch:
        """Encode; the teacher's log-probs (reverse KL) once; the student's old log-probs where the rollouts carry
        no sampled ones (compute_old; else those tokens are on-policy); RL advantages when rewards are given."""
        cfg, o = self.config, self.compute_options
        if rewards is not None and cfg.divergence == "jsd":
            raise ValueError("Distill divergence='jsd' takes no rewards; use divergence='reverse_kl' to add an "
                             "RL advantage")
        tb = P.train_batch(self.name, self.model, self.tokenizer, rollouts, o, temperature=cfg.temperature,
                           rewards=rewards, normalizer=lambda m: L.normalizer(cfg.aggregate, m))
        if self.kind != "rollouts":
            source.check_teacher_tokenizer(self.tokenizer, self.teacher_tokenizer, rollouts, tb.batch, o.max_length,
                                           o.truncate)
        if self.kind == "hf":
            P.check_token_ids(self.name, tb.batch, self.teacher, "the teacher")
        if cfg.divergence != "jsd":
            tb.teacher_logprobs = self.teacher_logprobs(rollouts, tb, cfg.teacher_temperature or tb.temperature)
        if compute_old and L.needs_old_pass(tb.sampler_logprobs, tb.mask):
            tb.old_logprobs = P.logprobs_pass(self.model, tb, o)
        if rewards is not None:
            r = tb.rewards.cpu()
            adv = cfg.rl_coef * group_relative_advantages(r, P.rollout_groups(rollouts, cfg.group_size),
                                                          cfg.scale_rewards)
            tb.metrics.update(reward_mean=r.mean().item(), rl_advantage_abs_mean=adv.abs().mean().item())
            tb.advantages = adv.to(tb.mask.device)
        return tb

    def compute(self, tb: P.TrainBatch, normalizer: float | None = None) -> L.LossOutput:
        """`LossOutput(loss, metrics, token_logprobs)` of a prepared (micro-)batch: the unit's metrics with the
        batch's (tensors until read); token_logprobs the student's (B, T), NaN where not trained."""
        if self.model.training and not self._dropout_checked:  # once, when it trains
            self._dropout_checked = warn_if_dropout(self.name, self.model)
        if self.config.divergence == "jsd":
            out = self._jsd(tb, normalizer)
        else:
            out = P.run_unit(distill_loss, self.config, self.model, tb, self.compute_options, normalizer)
        self.metrics, self.token_logprobs = out.metrics, out.token_logprobs  # the record of this call
        return out

    def _jsd(self, tb: P.TrainBatch, normalizer: float | None) -> L.LossOutput:
        B, T = tb.mask.shape
        hidden = hidden_states(self.model, tb, self.compute_options)  # (N, H)
        device = next(self.teacher.parameters()).device
        with torch.no_grad():
            th = self._teacher_hidden(tb, device)  # (N, H')
        index, teacher_head = tb.token_index, output_head(self.teacher)  # on the teacher's device
        extra = dict(hidden=hidden,
                     targets=tb.input_ids.reshape(-1).index_select(0, index + 1),
                     teacher_hidden=th,
                     head=output_head(self.model), teacher_head=lambda h: teacher_head(h).to(hidden.device),
                     softcap=logit_softcap(self.model), teacher_softcap=logit_softcap(self.teacher),
                     chunk_size=self.compute_options.chunk_size)
        out = jsd_loss(P.loss_inputs(tb, normalizer, extra=extra), self.config)
        metrics = L.LazyMetrics.merged(tb.metrics, out.metrics, temperature=tb.temperature)
        full = scatter_index(out.token_logprobs.float(), index + 1, (B, T), torch.nan)
        return L.LossOutput(out.loss, metrics, full)

    def _teacher_hidden(self, tb: P.TrainBatch, device: torch.device) -> torch.Tensor:
        """(N, H') the teacher's final hidden states that predict the trained tokens: in the student's layout on its
        device (packed where the teacher's attention takes it), else padded on the teacher's own device."""
        if device == tb.input_ids.device:
            return hidden_states(self.teacher, tb, self.compute_options)
        B, T = tb.mask.shape
        th = final_hidden_states(self.teacher, tb.input_ids.to(device), tb.attention_mask.to(device))  # (B, T, H')
        return th.reshape(B * T, -1).index_select(0, tb.token_index.to(device))

    def calculate_loss(self, rollouts, rewards=None, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over `rollouts` (and their (B,) rewards, if any), or over a prepared `TrainBatch`."""
        if isinstance(rollouts, P.TrainBatch):
            return self.compute(P.as_train_batch(rollouts, rewards, self.prepare), normalizer).loss
        return self.compute(self.prepare(rollouts, rewards, compute_old=False), normalizer).loss
