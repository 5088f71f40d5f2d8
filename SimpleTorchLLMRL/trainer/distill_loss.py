"""On-policy distillation as pure loss units: tensors in, `LossOutput(loss, metrics, token_logprobs)` out.

Legend: B rollouts, T tokens (per-token tensors are (B, T), aligned with input_ids), N trained
tokens, n of a chunk, H hidden size, V vocab.

Two units:

- `distill_loss`: the student sampled y_t; a teacher scored it. The per-token reverse KL,
  negated, is an advantage, A_t = -kl_coef (log p_student(y_t) - log p_teacher(y_t)) (+ an RL
  advantage), constant (no gradient through the teacher, the student term detached), in a
  policy-gradient loss -A_t r_t on the sampled tokens, r_t = pi / pi_old (or PPO-clipped).
  Its expected gradient is the gradient of KL(p_student || p_teacher) (Agarwal et al. 2024,
  GKD; Thinking Machines' on-policy distillation; `tests/test_distill.py` checks it exactly).
- `jsd_loss`: where the teacher's full distribution is available (an HF teacher with the
  student's vocabulary), the generalized Jensen-Shannon divergence of GKD per trained token,
  with TRL's `beta` convention (0: forward KL(teacher || student), 1: reverse KL(student ||
  teacher), between: beta KL(teacher || M) + (1 - beta) KL(student || M), M = beta teacher +
  (1 - beta) student), over chunks of trained tokens: one (n, V) block of logits at a time,
  recomputed in backward; never (B, T, V).

Metrics are 0-dim tensors in `combine_metrics`' form (the loss a share of the full batch's,
token means with `num_tokens`), so micro-batches add up to the full batch.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from SimpleTorchLLMRL.trainer.grpo_loss import LossOutput
from SimpleTorchLLMRL.trainer.losses import Clip, aggregation_weights, clipped_surrogate

DIVERGENCES = ("reverse_kl", "jsd")


def _check_shapes(**tensors) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token inputs must have one shape (B, T); got {shapes}")


def _mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Masked token mean as a detached 0-dim float tensor (0 without tokens)."""
    return ((x.detach().float() * m).sum() / m.sum().clamp(min=1))


def reverse_kl_advantages(*, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
    """A_t = -(log p_student(y_t) - log p_teacher(y_t)) on the trained tokens, 0 elsewhere; (B, T), detached."""
    _check_shapes(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, mask=mask)
    m = mask.bool()
    diff = student_logprobs.detach() - teacher_logprobs.detach()
    return torch.where(m, -diff, torch.zeros_like(diff))


def distill_loss(*, logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                 old_logprobs: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                 kl_coef: float = 1.0, clip: Clip | None = None, aggregate: str = "token_mean",
                 normalizer: float | None = None) -> LossOutput:
    """The reverse-KL-as-advantage policy-gradient loss of the trained tokens.

    logprobs (B, T): the student's log-probs of the sampled tokens, with grad.
    teacher_logprobs (B, T): the teacher's log-probs of the same tokens (treated as constants).
    mask (B, T): 1 on trained tokens. old_logprobs (B, T): the policy that sampled (the ratio's
    denominator and the student term of the advantage); None: on-policy, `logprobs` detached.
    advantages: an RL advantage added to the distillation one, (B,) per rollout or (B, T) per
    token (scale it yourself); None: distillation alone. kl_coef: the reverse KL's weight.
    clip: None, the plain surrogate -A r; a `Clip`, PPO's clipped surrogate.
    aggregate / normalizer: as `losses.aggregation_weights` (pass the FULL batch's normalizer
    when micro-batching: the parts' losses then add up to the full batch's).

    Returns `LossOutput(loss, metrics, logprobs (B, T) detached)`. Metrics: loss, reverse_kl
    (k1 estimate of KL(student || teacher) on the sampled tokens), advantage_mean, ratio_mean /
    min / max, clip_frac (with `clip`), num_tokens, num_sequences.
    """
    _check_shapes(logprobs=logprobs, teacher_logprobs=teacher_logprobs, mask=mask, old_logprobs=old_logprobs)
    m = mask.bool()
    zero = torch.zeros_like(logprobs)
    lp = torch.where(m, logprobs, zero)  # padding and untrained positions never reach the graph as NaN
    old = lp.detach() if old_logprobs is None else torch.where(m, old_logprobs.to(lp.dtype), zero)
    teacher = torch.where(m, teacher_logprobs.to(lp.dtype), zero)
    if bool(torch.isnan(torch.where(m, teacher_logprobs, 0.0)).any()):
        raise ValueError("teacher_logprobs is NaN on a trained token: every trained token needs a teacher score")
    adv = kl_coef * reverse_kl_advantages(student_logprobs=old, teacher_logprobs=teacher, mask=m)
    if advantages is not None:
        rl = advantages.to(lp.dtype)
        adv = adv + (rl[:, None].expand_as(lp) if rl.dim() == 1 else rl) * m
    log_ratio = lp - old
    if clip is None:
        per_token = -adv * torch.exp(log_ratio)
        clipped = torch.zeros_like(m)
    else:
        per_token, flags = clipped_surrogate(log_ratio, lp, adv, clip)
        clipped = flags["clipped_low"] | flags["clipped_high"]
    w = aggregation_weights(aggregate, m, normalizer).to(lp.dtype)  # (B, T), normalizer included
    loss = (per_token * w).sum()
    mf = m.float()
    ratio = torch.exp(log_ratio.detach())
    big = torch.finfo(ratio.dtype).max
    metrics = {
        "loss": loss.detach(),
        "reverse_kl": _mean(old - teacher, mf),
        "advantage_mean": _mean(adv, mf),
        "ratio_mean": _mean(ratio, mf),
        "ratio_min": torch.where(m, ratio, big).min().float(),
        "ratio_max": torch.where(m, ratio, -big).max().float(),
        "num_tokens": m.sum(),
        "num_sequences": torch.full((), m.shape[0], dtype=torch.long, device=m.device),
    }
    if clip is not None:
        metrics["clip_frac"] = _mean(clipped, mf)
    return LossOutput(loss, metrics, logprobs.detach())


# ---------------------------------------------------------------- full distributions: generalized JSD


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """(n, V) logits -> (n,) divergence per row, GKD's generalized JSD with TRL's `beta` convention.

    beta 0: KL(teacher || student) (forward); 1: KL(student || teacher) (reverse); between:
    beta KL(teacher || M) + (1 - beta) KL(student || M), M = beta teacher + (1 - beta) student.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must be in [0, 1], got {beta}")
    s = torch.log_softmax(student_logits, dim=-1)
    t = torch.log_softmax(teacher_logits, dim=-1)
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1)
    mix = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), dim=0)  # log M, (n, V)
    return beta * (t.exp() * (t - mix)).sum(-1) + (1 - beta) * (s.exp() * (s - mix)).sum(-1)


def _logits(head, h: torch.Tensor, softcap: float | None, inv_temp: float) -> torch.Tensor:
    z = head(h).float()  # (n, V)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z * inv_temp


def jsd_loss(*, hidden: torch.Tensor, head, teacher_hidden: torch.Tensor, teacher_head, targets: torch.Tensor,
             weight: torch.Tensor, beta: float = 0.5, temperature: float = 1.0, chunk_size: int = 512,
             softcap: float | None = None, teacher_softcap: float | None = None) -> LossOutput:
    """sum_i weight_i JSD_beta(student_i, teacher_i) over the N trained tokens, chunked.

    hidden (N, H) the student's final hidden states that predict targets (N,) through `head`;
    teacher_hidden (N, H') the teacher's at the same positions (no gradient flows into them)
    through `teacher_head`; weight (N,) the aggregator's weight of each token (normalizer
    included: `losses.aggregation_weights` picked at the trained tokens). Both heads must score
    the same vocabulary. Each chunk of `chunk_size` tokens builds its (n, V) logits under
    `torch.utils.checkpoint`, so backward recomputes them one chunk at a time.

    Returns `LossOutput(loss, metrics, student log-probs of targets (N,) detached)`; metrics:
    loss, jsd (token mean), num_tokens.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = hidden.shape[0]
    if teacher_hidden.shape[0] != n or targets.shape != (n,) or weight.shape != (n,):
        raise ValueError(f"jsd_loss: hidden {tuple(hidden.shape)}, teacher_hidden {tuple(teacher_hidden.shape)}, "
                         f"targets {tuple(targets.shape)} and weight {tuple(weight.shape)} must agree on N")
    inv_temp = 1.0 / temperature
    teacher_hidden = teacher_hidden.detach()

    def chunk(h, ht, y):
        zs = _logits(head, h, softcap, inv_temp)  # (n, V)
        with torch.no_grad():
            zt = _logits(teacher_head, ht, teacher_softcap, inv_temp)  # (n, V), a constant
        if zs.shape[-1] != zt.shape[-1]:
            raise ValueError(f"jsd needs one vocabulary: the student scores {zs.shape[-1]} ids, the teacher "
                             f"{zt.shape[-1]}; use the reverse-KL loss (log-probs of the sampled tokens only)")
        logp = zs.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(zs, dim=-1)
        return generalized_jsd(zs, zt, beta), logp

    grad = torch.is_grad_enabled()
    divs, logps = [], []
    for s in range(0, n, chunk_size):
        sl = slice(s, s + chunk_size)
        d, lp = (checkpoint(chunk, hidden[sl], teacher_hidden[sl], targets[sl], use_reentrant=False) if grad
                 else chunk(hidden[sl], teacher_hidden[sl], targets[sl]))
        divs.append(d)
        logps.append(lp.detach())
    div = torch.cat(divs) if divs else hidden.new_zeros(0, dtype=torch.float32)  # (N,)
    logp = torch.cat(logps) if logps else div.detach()
    loss = (div * weight.to(div.dtype)).sum()
    metrics = {"loss": loss.detach(), "jsd": div.detach().mean() if n else div.new_zeros(()),
               "num_tokens": torch.full((), n, dtype=torch.long, device=div.device)}
    return LossOutput(loss, metrics, logp)
