"""PPO with a value head (or a separate critic), per-token KL-shaped rewards and GAE: the unit and the front.

Legend: B rollouts, T tokens, N trained tokens, H hidden size. `values[:, t]` is the value of the
state that emits token t (read from the hidden state at t - 1, the forward of the log-probs).

    ppo = PPO(model, tokenizer, vf_coef=0.1, beta=0.05, ref_model=ref)
    optimizer = torch.optim.AdamW([*model.parameters(), *ppo.value_parameters()], lr=1e-5)
    loss = ppo.calculate_loss(rollouts, rewards)       # policy loss + vf_coef * value loss
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.model.dropout import warn_if_dropout
from SimpleTorchLLMRL.model.scoring.logprobs import ComputeOptions, hidden_states, scatter_index, score
from SimpleTorchLLMRL.trainer import losses as L
from SimpleTorchLLMRL.trainer import pipeline as P
from SimpleTorchLLMRL.trainer.grpo import whiten
from SimpleTorchLLMRL.trainer.off_policy import (
    OffPolicy,
    as_off_policy,
    correction_metrics,
    correction_weights,
)
from SimpleTorchLLMRL.trainer.options import build_options, front_options


def terminal_token_rewards(score: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each rollout's scalar score on its last trained token, (B, T)."""
    B, T = mask.shape
    last = (torch.arange(T, device=mask.device) * mask.bool()).argmax(-1)  # (B,)
    out = torch.zeros(B, T, dtype=score.dtype, device=mask.device)
    out[torch.arange(B, device=mask.device), last] = score.to(mask.device)
    return out * mask.to(out.dtype)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the trained tokens of each row: (advantages, returns) (B, T).

    Untrained tokens (prompt, tool output between turns) are not time steps: the recursion skips
    them, so the next state of a trained token is the next trained token; after the last one the
    episode ends (next value 0). Zero where mask is 0."""
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    B, T = rewards.shape
    m = mask.bool()
    adv = torch.zeros_like(rewards)
    next_value, last_gae = rewards.new_zeros(B), rewards.new_zeros(B)
    for t in reversed(range(T)):
        g = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * last_gae
        adv[:, t] = torch.where(m[:, t], g, torch.zeros_like(g))
        last_gae = torch.where(m[:, t], g, last_gae)
        next_value = torch.where(m[:, t], values[:, t], next_value)
    return adv, (adv + values) * m.to(values.dtype)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip_range: float | None) -> torch.Tensor:
    """PPO's clipped value loss per token: 0.5 max((v - R)^2, (v_old + clip(v - v_old) - R)^2)."""
    unclipped = (values - returns) ** 2
    if clip_range is None:
        return 0.5 * unclipped
    v_clip = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    return 0.5 * torch.maximum(unclipped, (v_clip - returns) ** 2)


@dataclass
class PPOConfig:
    """The options that change PPO's math; each is also a keyword argument of `PPO`."""

    eps: float = 0.2
    """The policy ratio is clipped to [1 - eps, 1 + eps_high]."""
    eps_high: float | None = None
    """The clip's upper width (None: eps)."""
    dual_clip: float | None = None
    """c > 1 caps the loss of negative advantages at -c A (None: off)."""
    vf_coef: float = 0.1
    """Weight of the value loss."""
    gamma: float = 1.0
    """GAE's discount."""
    lam: float = 0.95
    """GAE's lambda."""
    cliprange_value: float | None = 0.2
    """The values are clipped around the old values by this much (None: off)."""
    beta: float = 0.0
    """Weight of the per-token KL penalty in the reward (0: no reference pass)."""
    kl_estimator: str = "k1"
    """"k1" | "k2" | "k3": the estimator of that KL."""
    whiten_advantages: bool = True
    """Normalize the advantages over the batch's trained tokens."""
    temperature: float | None = None
    """None follows the rollouts' sampling temperature (1.0 when none is recorded), as GRPO's."""
    off_policy: OffPolicy | dict | None = None
    """The correction between the trainer's and the sampler's log-probs (`trainer.off_policy`), as GRPO's."""

    def __post_init__(self):
        checks = [
            ("vf_coef", self.vf_coef >= 0, ">= 0"), ("gamma", 0 <= self.gamma <= 1, "in [0, 1]"),
            ("lam", 0 <= self.lam <= 1, "in [0, 1]"), ("beta", self.beta >= 0, ">= 0"),
            ("cliprange_value", self.cliprange_value is None or self.cliprange_value > 0, "None or > 0"),
            ("kl_estimator", self.kl_estimator in L.KL_ESTIMATORS, f"one of {sorted(L.KL_ESTIMATORS)}"),
            ("temperature", self.temperature is None or self.temperature > 0, "None or > 0"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"PPO {name}={getattr(self, name)!r} is invalid; expected {allowed}")
        self.off_policy = as_off_policy("PPO", self.off_policy)
        self.clip = L.Clip(self.eps, self.eps if self.eps_high is None else self.eps_high, self.dual_clip)

    @property
    def token_level(self) -> bool:
        """Whether each token's loss depends on its own log-prob alone (the fused head may form its gradient)."""
        return not (self.off_policy is not None and self.off_policy.needs_whole_sequences)


def ppo_loss(inputs: L.LossInputs, config: PPOConfig) -> L.LossOutput:
    """PPO's loss: PPO-clip on pi / pi_old (times the off-policy weight) + vf_coef x the clipped value loss,
    both token means over the FULL batch's `normalizer` trained tokens; `LossOutput(..., token_logprobs (N,))`."""
    x, lp, op = inputs, inputs.logprobs, config.off_policy
    old, trainer_old = L.old_logprobs(lp, x.old_logprobs, x.sampler_logprobs, op)
    per_token, flags = L.clipped_surrogate(lp - old, lp, x.advantages, config.clip)
    metrics = {}
    if x.sampler_logprobs is not None:
        metrics.update(L.mismatch_metrics(trainer_old, x.sampler_logprobs, x.row, x.rows))
        if op is not None:
            tis, correction = correction_weights(op, trainer_old, x.sampler_logprobs, x.row, x.rows, x.advantages, lp)
            per_token = per_token * tis
            metrics.update(correction_metrics(tis, correction))
    w = L.weights("token_mean", x)
    policy = (per_token * w).sum()
    vf = (value_loss(x.values, x.old_values, x.returns, config.cliprange_value) * w).sum()
    loss = policy + config.vf_coef * vf
    with torch.no_grad():
        mean = lambda t: (t.detach().float().mean(), L.TOKEN_MEAN)  # noqa: E731  over the trained tokens
        metrics.update(loss=(loss.detach(), L.SUM), policy_loss=(policy.detach(), L.SUM), value_loss=(vf.detach(), L.SUM),
                       value_mean=mean(x.values), return_mean=mean(x.returns), advantage_mean=mean(x.advantages),
                       num_tokens=(L.count(x.num_tokens, lp), L.SUM), num_sequences=(L.count(x.rows, lp), L.SUM),
                       **L.ratio_metrics(torch.exp(lp.detach() - old), flags))
        if x.entropy is not None:
            metrics["entropy"] = mean(x.entropy)
        if x.ref_logprobs is not None:
            metrics["kl"] = mean(L.KL_ESTIMATORS[config.kl_estimator](lp, x.ref_logprobs))
    return L.LossOutput(loss, L.LazyMetrics.of(**metrics), lp.detach())


@front_options(PPOConfig)
class PPO:
    """Actor-critic PPO over `Rollout`s; `calculate_loss` returns policy + vf_coef * value loss.

    Options: `PPOConfig`'s and `ComputeOptions`', as GRPO's. value_head: a module (H -> 1), default a new
    Linear on the policy's (or the critic's) hidden size; critic: a separate model for the values;
    ref_model: the reference for beta > 0 (None with a peft model: its adapter off)."""

    name = "PPO"

    def __init__(self, model, tokenizer, config: PPOConfig | None = None, compute: ComputeOptions | None = None, *,
                 value_head: nn.Module | None = None, critic=None, ref_model=None, **options):
        self.config, self.compute_options = build_options(type(self), config, compute, options)
        P.check_policy(self.name, model, tokenizer, ref_model, self.config.beta)
        self.model, self.tokenizer, self.ref_model, self.critic = model, tokenizer, ref_model, critic
        if value_head is None:
            owner = critic if critic is not None else model
            size = getattr(getattr(owner, "config", None), "hidden_size", None)
            if size is None:
                raise ValueError(f"cannot read hidden_size from {type(owner).__name__}.config; pass value_head=")
            value_head = nn.Linear(int(size), 1)
            nn.init.normal_(value_head.weight, std=0.02)
            nn.init.zeros_(value_head.bias)
            value_head.to(P.model_device(owner))
        self.value_head = value_head
        self.policy_version: int | None = None  # the trainer's current version: staleness metrics when set
        self.metrics: dict = L.LazyMetrics()  # the last loss call's metrics (tensors until read)
        self.token_logprobs: torch.Tensor | None = None  # (B, T) of the last loss call, NaN where not trained
        self._dropout_checked = False

    def value_parameters(self) -> list[nn.Parameter]:
        """Parameters of the value head (and the critic, if any): add them to the optimizer."""
        critic = [] if self.critic is None else [p for p in self.critic.parameters() if p.requires_grad]
        return [*self.value_head.parameters(), *critic]

    def values(self, tb: P.TrainBatch, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T) values of the trained tokens (0 elsewhere) from the policy's (N, H) hidden states that predict
        them (`scoring.hidden_states`), or the critic's."""
        if self.critic is not None:
            hidden = hidden_states(self.critic, tb, self.compute_options)
        v = self.value_head(hidden.to(next(self.value_head.parameters()).dtype)).squeeze(-1).float()  # (N,)
        return scatter_index(v, tb.token_index + 1, tuple(tb.mask.shape))  # (B, T)

    def advantages(self, tb: P.TrainBatch, current: torch.Tensor, old_values: torch.Tensor):
        """(advantages, returns) (B, T): GAE of the terminal reward minus beta * KL(old || ref) per trained token."""
        cfg = self.config
        rewards = terminal_token_rewards(tb.rewards, tb.mask)
        if cfg.beta > 0:
            old = L.old_logprobs(current, tb.old_logprobs, tb.sampler_logprobs, cfg.off_policy)[0]
            rewards = rewards - cfg.beta * L.KL_ESTIMATORS[cfg.kl_estimator](old, tb.ref_logprobs) * tb.mask
        adv, returns = gae(rewards, old_values, tb.mask, cfg.gamma, cfg.lam)
        return (whiten(adv, tb.mask) if cfg.whiten_advantages else adv), returns

    def prepare(self, rollouts: list[Rollout], rewards, compute_old: bool = True) -> P.TrainBatch:
        """Encode; with compute_old, run the policy once without grad for old log-probs, values and GAE."""
        cfg, opts = self.config, self.compute_options
        tb = P.train_batch(self.name, self.model, self.tokenizer, rollouts, opts, temperature=cfg.temperature,
                           rewards=rewards, normalizer=lambda m: float(m.sum()),
                           metrics=P.staleness_metrics(rollouts, self.policy_version))
        r = tb.rewards
        tb.metrics.update(reward_mean=r.mean().item(), reward_std=r.std().item() if len(r) > 1 else 0.0)
        if cfg.beta > 0:
            tb.ref_logprobs = P.reference_logprobs(self.model, self.ref_model, tb, opts)
        if compute_old:
            with torch.no_grad():
                hidden = hidden_states(self.model, tb, opts)
                lp = score(self.model, tb, opts, temperature=tb.temperature, hidden=hidden).logprobs
                tb.old_values = self.values(tb, hidden)
            tb.old_logprobs = scatter_index(lp.float(), tb.token_index + 1, tuple(tb.mask.shape))
            tb.advantages, tb.returns = self.advantages(tb, tb.old_logprobs, tb.old_values)
        return tb

    def compute(self, tb: P.TrainBatch, normalizer: float | None = None) -> L.LossOutput:
        """`LossOutput(loss, metrics, token_logprobs)` of a prepared (micro-)batch: `ppo_loss`'s metrics with the
        batch's, token_logprobs (B, T), NaN where not trained. normalizer: the FULL batch's trained tokens."""
        if self.model.training and not self._dropout_checked:  # once, when it trains
            self._dropout_checked = warn_if_dropout(self.name, self.model)
        opts = self.compute_options
        hidden = hidden_states(self.model, tb, opts)  # (N, H)
        values = self.values(tb, hidden)
        old_values = tb.old_values if tb.old_values is not None else values.detach()
        if tb.advantages is not None:
            out = P.run_unit(ppo_loss, self.config, self.model, tb, opts, normalizer, hidden=hidden, values=values,
                             old_values=old_values)
        else:  # on-policy: the advantages come from this forward's own log-probs and values
            s = score(self.model, tb, opts, temperature=tb.temperature, hidden=hidden)
            current = scatter_index(s.logprobs.detach().float(), tb.token_index + 1, tuple(tb.mask.shape))
            adv, returns = self.advantages(tb, current, old_values)
            out = P.run_unit(ppo_loss, self.config, self.model, tb, opts, normalizer, scores=s, values=values,
                             old_values=old_values, advantages=adv, returns=returns)
        self.metrics, self.token_logprobs = out.metrics, out.token_logprobs  # the record of this call
        return out

    def calculate_loss(self, rollouts, rewards=None, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over `rollouts` and their (B,) rewards, or over a prepared `TrainBatch`."""
        return self.compute(P.as_train_batch(rollouts, rewards, self.prepare), normalizer).loss
