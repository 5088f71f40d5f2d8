"""PPO's loss unit, pure: (B, T) token tensors in, `LossOutput(loss, metrics, token_logprobs)` out.

Legend: B rollouts, T tokens, N trained tokens. Per-token tensors are (B, T), aligned with input_ids.

    out = ppo_loss(logprobs=lp, mask=mask, config=PPOConfig(), normalizer=float(mask.sum()),
                   advantages=adv, values=v, old_values=v_old, returns=ret,
                   old_logprobs=old, sampler_logprobs=sampled, ref_logprobs=ref, entropy=ent)

Policy loss (PPO-clip on the ratio pi / pi_old, times the off-policy weight) + vf_coef x clipped
value loss, both token means over the FULL batch's `normalizer` trained tokens. What "old" is:
`losses.old_and_tis` (the sampler's log-probs where known, else the trainer's), or with an
off-policy correction the trainer's own (decoupled PPO) and the weight of `trainer.off_policy`.
The metrics are 0-dim tensors (a `LazyMetrics`, no host sync) in `combine_metrics`' form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from SimpleTorchLLMRL.trainer.batch import trained_index
from SimpleTorchLLMRL.trainer.combine import LazyMetrics
from SimpleTorchLLMRL.trainer.losses import (
    KL_ESTIMATORS,
    Clip,
    LossOutput,
    clipped_surrogate,
    old_and_tis,
    token_mean,
    value_loss,
)
from SimpleTorchLLMRL.trainer.off_policy import (
    OffPolicy,
    as_off_policy,
    correction_metrics,
    correction_weights,
    mismatch_metrics,
)

__all__ = ["PPOConfig", "ppo_loss", "ppo_token_loss", "ratio_old", "off_policy_terms"]


@dataclass
class PPOConfig:
    """The options that change PPO's math; each is also a keyword argument of `PPO`.

    eps / eps_high / dual_clip: policy ratio clip. vf_coef: weight of the value loss.
    gamma, lam: GAE. cliprange_value: value clip around the old values (None: off).
    beta: per-token KL penalty in the reward (kl_estimator, default k1); 0 skips the reference.
    whiten_advantages: normalize advantages over the batch's trained tokens.
    temperature: None follows the rollouts' sampling temperature (see GRPOConfig).
    off_policy: an `OffPolicy` (or a dict of its fields), the correction between the trainer's and the
    sampler's log-probs (`trainer.off_policy`; see GRPOConfig); tis_cap=c: its old spelling of OffPolicy.tis(c).
    (chunk_size, head_impl, fused, share_prefix, max_length, truncate are `ComputeOptions`.)
    """

    eps: float = 0.2
    eps_high: float | None = None
    dual_clip: float | None = None
    vf_coef: float = 0.1
    gamma: float = 1.0
    lam: float = 0.95
    cliprange_value: float | None = 0.2
    beta: float = 0.0
    kl_estimator: str = "k1"
    whiten_advantages: bool = True
    temperature: float | None = None
    tis_cap: float | None = None
    off_policy: OffPolicy | dict | None = None

    def __post_init__(self):
        checks = [
            ("vf_coef", self.vf_coef >= 0, ">= 0"), ("gamma", 0 <= self.gamma <= 1, "in [0, 1]"),
            ("lam", 0 <= self.lam <= 1, "in [0, 1]"), ("beta", self.beta >= 0, ">= 0"),
            ("cliprange_value", self.cliprange_value is None or self.cliprange_value > 0, "None or > 0"),
            ("kl_estimator", self.kl_estimator in KL_ESTIMATORS, f"one of {sorted(KL_ESTIMATORS)}"),
            ("temperature", self.temperature is None or self.temperature > 0, "None or > 0"),
            ("tis_cap", self.tis_cap is None or self.tis_cap > 0, "None or > 0"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"PPO {name}={getattr(self, name)!r} is invalid; expected {allowed}")
        self.off_policy = as_off_policy("PPO", self.off_policy, self.tis_cap)
        self.clip = Clip(self.eps, self.eps if self.eps_high is None else self.eps_high, self.dual_clip)


def ppo_token_loss(config: PPOConfig, logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor,
                   weight: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """(per-token policy loss, clip flags), any shape: PPO-clip on exp(logp - old), times the off-policy weight."""
    per_token, clip_stats = clipped_surrogate(logp - old, logp, advantages, config.clip)
    return (per_token if weight is None else per_token * weight), clip_stats


def ppo_loss(*, logprobs: torch.Tensor, mask: torch.Tensor, config: PPOConfig, normalizer: float,
             advantages: torch.Tensor, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
             old_logprobs: torch.Tensor | None = None, sampler_logprobs: torch.Tensor | None = None,
             ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
             index: torch.Tensor | None = None, policy_loss: torch.Tensor | None = None) -> LossOutput:
    """PPO's loss: policy loss + vf_coef * value loss, and its metrics. Every tensor (B, T).

    logprobs: the policy's log-probs of the tokens, with grad; old_logprobs: the trainer's before
    the update (None: on-policy, `logprobs` detached); sampler_logprobs: the generator's (NaN
    where unknown, None when no rollout has any); ref_logprobs: the reference's (the `kl` metric);
    advantages (B, T) or (B, 1); values with grad, old_values and returns: the value loss;
    normalizer: the FULL batch's trained tokens; entropy: the `entropy` metric when given.
    index: `batch.trained_index(mask)` (N,), found before the forward (None: found here, one host sync).
    policy_loss: the policy term when the head already formed it chunk by chunk (PPO's `fused=True`,
    `model.scoring.logprobs.fused_token_loss`); `logprobs` then only feed the metrics.
    """
    for name, t in (("old_logprobs", old_logprobs), ("sampler_logprobs", sampler_logprobs),
                    ("ref_logprobs", ref_logprobs), ("values", values), ("old_values", old_values),
                    ("returns", returns)):
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"ppo_loss: {name} has shape {tuple(t.shape)}, mask {tuple(mask.shape)}; expected (B, T)")
    index = index if index is not None else trained_index(mask)
    trainer_old = old_logprobs if old_logprobs is not None else logprobs.detach()
    old = ratio_old(trainer_old, sampler_logprobs, mask, config.off_policy)
    tis, off = off_policy_terms(config.off_policy, trainer_old, sampler_logprobs, advantages, logprobs, index)
    if policy_loss is None:
        per_token, clip_stats = ppo_token_loss(config, logprobs, old, advantages, tis)
        policy_loss = token_mean(per_token, mask, normalizer)
    else:
        with torch.no_grad():
            clip_stats = ppo_token_loss(config, logprobs.detach(), old, advantages, tis)[1]
    vf_loss = token_mean(value_loss(values, old_values, returns, config.cliprange_value), mask, normalizer)
    loss = policy_loss + config.vf_coef * vf_loss
    with torch.no_grad():  # 0-dim tensors: nothing waits for the device until the metrics are read
        m = mask.bool()
        mf = m.float()
        count = mf.sum()
        mean = lambda x: (x.detach().float() * mf).sum() / count  # noqa: E731  over the trained tokens
        ratio = torch.exp(logprobs.detach() - old)
        low, high = mean(clip_stats["clipped_low"]), mean(clip_stats["clipped_high"])
        metrics = LazyMetrics(loss=loss.detach(), policy_loss=policy_loss.detach(), value_loss=vf_loss.detach())
        if entropy is not None:
            metrics["entropy"] = mean(entropy)
        metrics.update(value_mean=mean(values), return_mean=mean(returns),
                       advantage_mean=mean(advantages.expand_as(mf)), clip_frac_low=low, clip_frac_high=high,
                       ratio_mean=mean(ratio), ratio_min=torch.where(m, ratio, torch.inf).min(),
                       ratio_max=torch.where(m, ratio, -torch.inf).max(), num_tokens=m.sum(),
                       num_sequences=torch.full((), mask.shape[0], dtype=torch.long, device=mask.device),
                       clip_frac=low + high)
        if ref_logprobs is not None:
            metrics["kl"] = mean(KL_ESTIMATORS[config.kl_estimator](logprobs, ref_logprobs))
        metrics.update(off)
    return LossOutput(loss, metrics, logprobs.detach())


def ratio_old(trainer_old: torch.Tensor, sampled: torch.Tensor | None, mask: torch.Tensor | None,
              off_policy: OffPolicy | None) -> torch.Tensor:
    """The old log-probs of the ratio, (B, T): with a correction the trainer's own, else the sampler's where known."""
    if off_policy is None:
        return old_and_tis(trainer_old, sampled, mask, None)[0]
    return trainer_old if mask is None else torch.where(mask.bool(), trainer_old, 0.0)


def off_policy_terms(op: OffPolicy | None, trainer_old: torch.Tensor, sampled: torch.Tensor | None,
                     adv: torch.Tensor, logp: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
    """(the correction weight (B, T) or None, its and the mismatch's metrics) at the trained tokens.

    index: `trained_index(mask)` (N,); the trained tokens are at index + 1 of the flat (B, T) batch.
    No host sync: the tokens are read with `index_select`, the weights written back with `index_copy`."""
    if sampled is None:
        return None, {}
    B, T = trainer_old.shape
    at = index + 1  # (N,) flat positions of the trained tokens
    pick = lambda t: t.reshape(-1).index_select(0, at)  # noqa: E731  (B, T) -> (N,)
    row = torch.div(at, T, rounding_mode="floor")
    metrics = mismatch_metrics(pick(trainer_old), pick(sampled), row, B)
    if op is None:
        return None, metrics
    weight, stats = correction_weights(op, pick(trainer_old), pick(sampled), row, B, pick(adv.expand(B, T)),
                                       pick(logp))
    metrics.update(correction_metrics(weight, stats))
    full = torch.ones(B * T, dtype=weight.dtype, device=weight.device).index_copy(0, at, weight).view(B, T)
    return full, metrics
