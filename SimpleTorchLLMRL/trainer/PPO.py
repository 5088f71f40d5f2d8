"""PPO with a value head (or a separate critic), per-token KL-shaped rewards and GAE.

Legend: B rollouts, T tokens, H hidden size. Per-token tensors are (B, T),
aligned with input_ids: `values[:, t]` is the value of the state that emits
token t (read from the hidden state at t - 1), column 0 is 0.

    ppo = PPO(model, tokenizer, vf_coef=0.1, beta=0.05, ref_model=ref)
    optimizer = torch.optim.AdamW([*model.parameters(), *ppo.value_parameters()], lr=1e-5)
    loss = ppo.calculate_loss(rollouts, rewards)       # policy loss + vf_coef * value loss
    loss.backward(); optimizer.step(); optimizer.zero_grad()

The value head reads the policy's final hidden states from the same forward
that gives the chunked log-probs (no second pass). `prepare` + `split` work as
for GRPO for several epochs / micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.model.logprobs import (
    DEFAULT_CHUNK_SIZE,
    final_hidden_states,
    logprobs_at,
    token_logprobs,
)
from SimpleTorchLLMRL.trainer import advantages as A
from SimpleTorchLLMRL.trainer.batch import (
    ComputeOptions,
    StepOutput,
    TrainBatch,
    as_train_batch,
    check_policy,
    check_rewards,
    encode,
    model_device,
    old_and_tis,
    reference_logprobs,
    resolve_temperature,
    staleness_metrics,
    trained_index,
    trained_mask,
    warn_if_dropout,
)
from SimpleTorchLLMRL.trainer.combine import LazyMetrics
from SimpleTorchLLMRL.trainer.losses import KL_ESTIMATORS, Clip, clipped_surrogate, token_mean, value_loss
from SimpleTorchLLMRL.trainer.off_policy import (
    OffPolicy,
    as_off_policy,
    correction_metrics,
    correction_weights,
    mismatch_metrics,
)


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
    (chunk_size, head_impl, max_length, truncate are `ComputeOptions`.)
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


def ppo_loss(logp: torch.Tensor, entropy: torch.Tensor, values: torch.Tensor, old: torch.Tensor,
             tis: torch.Tensor | None, adv: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor,
             mask: torch.Tensor, config: PPOConfig, normalizer: float,
             ref_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, LazyMetrics]:
    """PPO's loss unit, pure: policy loss + vf_coef * value loss (token means over the FULL batch's
    `normalizer` trained tokens), and its metrics in `combine_metrics` form (a `LazyMetrics`: tensors
    until read, no host sync). Every tensor (B, T)."""
    per_token, clip_stats = clipped_surrogate(logp - old, logp, adv, config.clip)
    if tis is not None:
        per_token = per_token * tis
    policy_loss = token_mean(per_token, mask, normalizer)
    vf_loss = token_mean(value_loss(values, old_values, returns, config.cliprange_value), mask, normalizer)
    loss = policy_loss + config.vf_coef * vf_loss
    with torch.no_grad():  # 0-dim tensors: nothing waits for the device until the metrics are read
        m = mask.bool()
        mf = m.float()
        count = mf.sum()
        mean = lambda x: (x.detach().float() * mf).sum() / count  # noqa: E731  over the trained tokens
        ratio = torch.exp(logp.detach() - old)
        low, high = mean(clip_stats["clipped_low"]), mean(clip_stats["clipped_high"])
        metrics = LazyMetrics(loss=loss.detach(), policy_loss=policy_loss.detach(), value_loss=vf_loss.detach(),
                              entropy=mean(entropy), value_mean=mean(values), return_mean=mean(returns),
                              advantage_mean=mean(adv), clip_frac_low=low, clip_frac_high=high,
                              ratio_mean=mean(ratio), ratio_min=torch.where(m, ratio, torch.inf).min(),
                              ratio_max=torch.where(m, ratio, -torch.inf).max(), num_tokens=m.sum(),
                              num_sequences=mask.shape[0], clip_frac=low + high)
        if ref_logprobs is not None:
            metrics["kl"] = mean(KL_ESTIMATORS[config.kl_estimator](logp, ref_logprobs))
    return loss, metrics


def ratio_old(trainer_old: torch.Tensor, sampled: torch.Tensor | None, mask: torch.Tensor,
              off_policy: OffPolicy | None) -> torch.Tensor:
    """The old log-probs of the ratio, (B, T): with a correction the trainer's own, else the sampler's where known."""
    if off_policy is None:
        return old_and_tis(trainer_old, sampled, mask, None)[0]
    return torch.where(mask.bool(), trainer_old, 0.0)


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


def hidden_size(model) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None)
    if size is None:
        raise ValueError(f"cannot read hidden_size from {type(model).__name__}.config; pass value_head=")
    return int(size)


class PPO:
    """Actor-critic PPO over `Rollout`s; `calculate_loss` returns policy + vf_coef * value loss.

    `metrics` and `token_logprobs` record the last loss call; `compute` returns them."""

    name = "PPO"

    def __init__(self, model, tokenizer, value_head: nn.Module | None = None, critic=None, ref_model=None, *,
                 eps: float = 0.2, eps_high: float | None = None, dual_clip: float | None = None,
                 vf_coef: float = 0.1, gamma: float = 1.0, lam: float = 0.95, cliprange_value: float | None = 0.2,
                 beta: float = 0.0, kl_estimator: str = "k1", whiten_advantages: bool = True,
                 temperature: float | None = None, tis_cap: float | None = None,
                 off_policy: OffPolicy | dict | None = None,
                 chunk_size: int | None = DEFAULT_CHUNK_SIZE, head_impl: str = "auto", max_length: int | None = None,
                 truncate: bool = False):
        """The options are PPOConfig's and ComputeOptions' (see their docstrings); value_head: a module
        (H -> 1), default a new Linear on the policy's (or the critic's) hidden size; critic: a separate
        model for the values."""
        self.config = PPOConfig(eps=eps, eps_high=eps_high, dual_clip=dual_clip, vf_coef=vf_coef, gamma=gamma,
                                lam=lam, cliprange_value=cliprange_value, beta=beta, kl_estimator=kl_estimator,
                                whiten_advantages=whiten_advantages, temperature=temperature, tis_cap=tis_cap,
                                off_policy=off_policy)
        self.compute_options = ComputeOptions(chunk_size=chunk_size, head_impl=head_impl, max_length=max_length,
                                              truncate=truncate)
        check_policy(self.name, model, tokenizer, ref_model, self.config.beta)
        self.model, self.tokenizer, self.ref_model, self.critic = model, tokenizer, ref_model, critic
        if value_head is None:
            value_head = nn.Linear(hidden_size(critic if critic is not None else model), 1)
            nn.init.normal_(value_head.weight, std=0.02)
            nn.init.zeros_(value_head.bias)
            value_head.to(model_device(critic if critic is not None else model))
        self.value_head = value_head
        self.policy_version: int | None = None  # the trainer's current version: staleness metrics when set
        self.metrics: dict[str, float] = LazyMetrics()  # the last loss call's metrics (tensors until read)
        self.token_logprobs: torch.Tensor | None = None  # (B, T) of the last loss call, NaN where not trained
        self._dropout_checked = False

    def value_parameters(self) -> list[nn.Parameter]:
        """Parameters of the value head (and the critic, if any): add them to the optimizer."""
        params = list(self.value_head.parameters())
        if self.critic is not None:
            params += [p for p in self.critic.parameters() if p.requires_grad]
        return params

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) final hidden states -> (B, T) values aligned with input_ids (column 0 is 0)."""
        head_dtype = next(self.value_head.parameters()).dtype
        v = self.value_head(hidden[:, :-1].to(head_dtype)).squeeze(-1).float()  # (B, T-1)
        return torch.cat([v.new_zeros(v.shape[0], 1), v], dim=1)

    def _forward(self, batch, mask, temperature, index=None):
        """One policy forward -> (logp, entropy, values), all (B, T); index: `trained_index(mask)` (no sync)."""
        # a Batch is right-padded: a causal mask alone keeps padding out of every real position (no host sync)
        hidden = final_hidden_states(self.model, batch.input_ids, batch.attention_mask, right_padded=True)
        logp, ent = logprobs_at(hidden, self.model, batch.input_ids, mask, temperature=temperature,
                                chunk_size=self.compute_options.chunk_size, head_impl=self.compute_options.head_impl,
                                index=index, truncation=batch.truncation)
        if self.critic is not None:
            hidden = final_hidden_states(self.critic, batch.input_ids, batch.attention_mask, right_padded=True)
        return logp, ent, self.values(hidden) * mask.to(torch.float32)

    def token_rewards(self, tb: TrainBatch, old_logp: torch.Tensor) -> torch.Tensor:
        """Terminal reward on the last trained token minus beta * KL(old || ref) on every trained token, (B, T)."""
        r = A.terminal_token_rewards(tb.rewards, tb.mask)
        if self.config.beta > 0:
            kl = KL_ESTIMATORS[self.config.kl_estimator](old_logp, tb.ref_logprobs)
            r = r - self.config.beta * kl * tb.mask.to(r.dtype)
        return r

    def _advantages(self, tb: TrainBatch, old_logp: torch.Tensor, old_values: torch.Tensor):
        rewards = self.token_rewards(tb, old_logp)
        adv, returns = A.gae(rewards, old_values, tb.mask, self.config.gamma, self.config.lam)
        if self.config.whiten_advantages:
            adv = A.whiten(adv, tb.mask)
        return adv, returns

    def prepare(self, rollouts: list[Rollout], rewards, compute_old: bool = True) -> TrainBatch:
        """Encode; with compute_old, run the policy once without grad for old log-probs, values and GAE."""
        cfg, opts = self.config, self.compute_options
        r = check_rewards(rewards, len(rollouts))
        batch = encode(self.name, rollouts, self.tokenizer, model_device(self.model), opts.max_length, opts.truncate)
        mask = trained_mask(batch)
        index = trained_index(mask)  # (N,) found before any forward: the loss never waits for the device
        temperature = resolve_temperature(self.name, cfg.temperature, batch.sampling_temperature)
        ref = None
        if cfg.beta > 0:
            ref = reference_logprobs(self.model, self.ref_model, lambda m: token_logprobs(
                m, batch, temperature, opts.chunk_size, positions=mask, head_impl=opts.head_impl,
                truncation=batch.truncation))
        tb = TrainBatch(batch, mask, r.to(batch.input_ids.device), temperature, float(mask.sum()), ref_logprobs=ref,
                        metrics={"reward_mean": r.mean().item(), "reward_std": r.std().item() if len(r) > 1 else 0.0,
                                 "temperature": temperature, **staleness_metrics(rollouts, self.policy_version)},
                        token_index=index)
        if compute_old:
            with torch.no_grad():
                logp, _, values = self._forward(batch, mask, temperature, index)
            old = ratio_old(logp, batch.sampler_logprobs, mask, cfg.off_policy)
            tb.old_logprobs, tb.old_values = logp, values
            tb.advantages, tb.returns = self._advantages(tb, old, values)
        return tb

    def compute(self, tb: TrainBatch, normalizer: float | None = None) -> StepOutput:
        """Loss, metrics and recomputed log-probs of a prepared (micro-)batch.

        normalizer: the FULL batch's trained tokens when micro-batching yourself (a `split` keeps it)."""
        cfg, mask = self.config, tb.mask
        if not self._dropout_checked:
            self._dropout_checked = warn_if_dropout(self.name, self.model)
        index = tb.token_index if tb.token_index is not None else trained_index(mask)
        logp, ent, values = self._forward(tb.batch, mask, tb.temperature, index)
        trainer_old = tb.old_logprobs if tb.old_logprobs is not None else logp.detach()
        old = ratio_old(trainer_old, tb.sampler_logprobs, mask, cfg.off_policy)
        old_values = tb.old_values if tb.old_values is not None else values.detach()
        adv, returns = (tb.advantages, tb.returns) if tb.advantages is not None else self._advantages(
            tb, old, old_values)
        norm = normalizer if normalizer is not None else tb.normalizer
        tis, off = off_policy_terms(cfg.off_policy, trainer_old, tb.sampler_logprobs, adv, logp, index)
        loss, metrics = ppo_loss(logp, ent, values, old, tis, adv, returns, old_values, mask, cfg, norm,
                                 tb.ref_logprobs)
        metrics.update(off)
        metrics = LazyMetrics.merged(tb.metrics, metrics, temperature=tb.temperature)  # tensors until read
        full = torch.where(mask.bool(), logp.detach().float(), torch.nan)  # (B, T), for `logprob_drift`
        self.metrics, self.token_logprobs = metrics, full  # the record of this call
        return StepOutput(loss, metrics, full)

    def loss(self, tb: TrainBatch, normalizer: float | None = None) -> torch.Tensor:
        """The scalar loss of a prepared (micro-)batch (`compute(...).loss`)."""
        return self.compute(tb, normalizer).loss

    def calculate_loss(self, rollouts, rewards=None, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over `rollouts` and their (B,) rewards, or over a prepared `TrainBatch`."""
        return self.compute(as_train_batch(rollouts, rewards, self.prepare), normalizer).loss
