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

import torch
from torch import nn

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.model.scoring.head import logit_softcap, output_head, supports_fused
from SimpleTorchLLMRL.model.scoring.hidden import final_hidden_states
from SimpleTorchLLMRL.model.scoring.logprobs import fused_token_loss, logprobs_at, token_logprobs
from SimpleTorchLLMRL.model.scoring.shared_prefix import PrefixPlan, first_positions, plan_shared_prefix
from SimpleTorchLLMRL.trainer import advantages as A
from SimpleTorchLLMRL.trainer.batch import (
    StepOutput,
    TrainBatch,
    as_train_batch,
    check_policy,
    check_rewards,
    encode,
    model_device,
    reference_logprobs,
    resolve_temperature,
    staleness_metrics,
    trained_index,
    trained_mask,
    warn_if_dropout,
)
from SimpleTorchLLMRL.trainer.combine import LazyMetrics
from SimpleTorchLLMRL.trainer.losses import KL_ESTIMATORS, LossOutput
from SimpleTorchLLMRL.trainer.off_policy import OffPolicy, correction_weights
from SimpleTorchLLMRL.trainer.options import UNSET, ComputeOptions, build_options, named_options
from SimpleTorchLLMRL.trainer.ppo_loss import (  # noqa: F401  (their old import path)
    PPOConfig,
    off_policy_terms,
    ppo_loss,
    ppo_token_loss,
    ratio_old,
)

__all__ = ["PPO", "PPOConfig", "ppo_loss", "TrainBatch", "StepOutput", "LossOutput"]

_NOT_OPTIONS = frozenset({"self", "model", "tokenizer", "config", "compute", "value_head", "critic", "ref_model"})


def hidden_size(model) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None)
    if size is None:
        raise ValueError(f"cannot read hidden_size from {type(model).__name__}.config; pass value_head=")
    return int(size)


class PPO:
    """Actor-critic PPO over `Rollout`s; `calculate_loss` returns policy + vf_coef * value loss.

    `PPO(model, tokenizer, config=None, compute=None, **options)`, as `GRPO`: options are `PPOConfig`'s and
    `ComputeOptions`' (chunk_size, head_impl, fused, share_prefix, max_length, truncate), each a named keyword
    argument, plus value_head, critic and ref_model; an unknown one raises `UnknownOptionError` (a TypeError).
    `metrics` and `token_logprobs` record the last loss call; `compute` returns them."""

    name = "PPO"

    @named_options
    def __init__(self, model, tokenizer, config: PPOConfig | None = None, compute: ComputeOptions | None = None, *,
                 value_head: nn.Module | None = None, critic=None, ref_model=None,
                 eps: float = UNSET, eps_high: float | None = UNSET, dual_clip: float | None = UNSET,
                 vf_coef: float = UNSET, gamma: float = UNSET, lam: float = UNSET,
                 cliprange_value: float | None = UNSET, beta: float = UNSET, kl_estimator: str = UNSET,
                 whiten_advantages: bool = UNSET, temperature: float | None = UNSET, tis_cap: float | None = UNSET,
                 off_policy: OffPolicy | dict | None = UNSET,
                 chunk_size: int | None = UNSET, head_impl: str = UNSET, max_length: int | None = UNSET,
                 truncate: bool = UNSET, fused: bool | None = UNSET, share_prefix: bool = UNSET):
        """config: a `PPOConfig` (the math), compute: `ComputeOptions` (how it is computed); each keyword
        overrides its field (left out: the config's value, else the default documented there).
        value_head: a module (H -> 1), default a new Linear on the policy's (or the critic's) hidden size;
        critic: a separate model for the values; ref_model: the reference for beta > 0 (None with a peft
        model: its adapter off). fused=True: the policy term's gradient is formed chunk by chunk in the
        forward when the head allows (a prepared batch, token-level corrections); None / False: two passes."""
        given = {k: v for k, v in locals().items() if k not in _NOT_OPTIONS}
        self.config, self.compute_options = build_options(self.name, PPOConfig, config, compute, given)
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

    def prefix_plan(self, batch, mask: torch.Tensor) -> PrefixPlan:
        """Which rows share their tokens before the first trained one (`share_prefix`); waits for the device."""
        return plan_shared_prefix(batch.input_ids, batch.attention_mask, first_positions(mask))

    def _hidden(self, model, batch, plan: PrefixPlan | None) -> torch.Tensor:
        """(B, T, H) final hidden states of a right-padded batch (exact from each row's first trained position)."""
        return final_hidden_states(model, batch.input_ids, batch.attention_mask, prefix_plan=plan, right_padded=True)

    def _forward(self, batch, mask, temperature, index=None, plan: PrefixPlan | None = None):
        """One policy forward -> (logp, entropy, values, hidden), all (B, T) but hidden (B, T, H).

        index: `trained_index(mask)` (no sync); plan: the shared prefixes (`share_prefix`)."""
        o = self.compute_options
        hidden = self._hidden(self.model, batch, plan)
        logp, ent = logprobs_at(hidden, self.model, batch.input_ids, mask, temperature=temperature,
                                chunk_size=o.chunk_size, head_impl=o.head_impl, index=index,
                                truncation=batch.truncation)
        return logp, ent, self._values(batch, mask, hidden, plan), hidden

    def _values(self, batch, mask, hidden, plan):
        if self.critic is not None:
            hidden = self._hidden(self.critic, batch, plan)
        return self.values(hidden) * mask.to(torch.float32)

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
        plan = self.prefix_plan(batch, mask) if opts.share_prefix else None  # found before any forward
        if cfg.beta > 0:
            ref = reference_logprobs(self.model, self.ref_model, lambda m: token_logprobs(
                m, batch, temperature, opts.chunk_size, positions=mask, head_impl=opts.head_impl,
                share_prefix=opts.share_prefix, truncation=batch.truncation))
        tb = TrainBatch(batch, mask, r.to(batch.input_ids.device), temperature, float(mask.sum()), ref_logprobs=ref,
                        metrics={"reward_mean": r.mean().item(), "reward_std": r.std().item() if len(r) > 1 else 0.0,
                                 "temperature": temperature, **staleness_metrics(rollouts, self.policy_version)},
                        token_index=index, prefix_plan=plan)
        if compute_old:
            with torch.no_grad():
                logp, _, values, _ = self._forward(batch, mask, temperature, index, plan)
            old = ratio_old(logp, batch.sampler_logprobs, mask, cfg.off_policy)
            tb.old_logprobs, tb.old_values = logp, values
            tb.advantages, tb.returns = self._advantages(tb, old, values)
        return tb

    def compute(self, tb: TrainBatch, normalizer: float | None = None) -> LossOutput:
        """`LossOutput(loss, metrics, token_logprobs)` of a prepared (micro-)batch (`ppo_loss` plus the batch's
        metrics; token_logprobs (B, T), NaN where not trained).

        normalizer: the FULL batch's trained tokens when micro-batching yourself (a `split` keeps it)."""
        cfg, opts, mask = self.config, self.compute_options, tb.mask
        if not self._dropout_checked:
            self._dropout_checked = warn_if_dropout(self.name, self.model)
        index = tb.token_index if tb.token_index is not None else trained_index(mask)
        plan = (tb.prefix_plan if tb.prefix_plan is not None else self.prefix_plan(tb.batch, mask)) \
            if opts.share_prefix else None
        norm = normalizer if normalizer is not None else tb.normalizer
        policy_loss = None
        if self._fused(tb):
            logp, ent, values, policy_loss = self._fused_forward(tb, index, plan, norm)
        else:
            logp, ent, values, _ = self._forward(tb.batch, mask, tb.temperature, index, plan)
        trainer_old = tb.old_logprobs if tb.old_logprobs is not None else logp.detach()
        old_values = tb.old_values if tb.old_values is not None else values.detach()
        adv, returns = (tb.advantages, tb.returns) if tb.advantages is not None else self._advantages(
            tb, ratio_old(trainer_old, tb.sampler_logprobs, mask, cfg.off_policy), old_values)
        out = ppo_loss(logprobs=logp, mask=mask, config=cfg, normalizer=norm, advantages=adv, values=values,
                       old_values=old_values, returns=returns, old_logprobs=tb.old_logprobs,
                       sampler_logprobs=tb.sampler_logprobs, ref_logprobs=tb.ref_logprobs, entropy=ent, index=index,
                       policy_loss=policy_loss)
        metrics = LazyMetrics.merged(tb.metrics, out.metrics, temperature=tb.temperature)  # tensors until read
        full = torch.where(mask.bool(), logp.detach().float(), torch.nan)  # (B, T), for `logprob_drift`
        self.metrics, self.token_logprobs = metrics, full  # the record of this call
        return LossOutput(out.loss, metrics, full)

    def _fused(self, tb: TrainBatch) -> bool:
        """Whether the policy gradient is formed chunk by chunk in the forward: fused=True (None and False: the
        two-pass head), a prepared batch (advantages known before the forward), token-level corrections only
        and a plain Linear head; otherwise two passes, with the same values."""
        op = self.config.off_policy
        return (self.compute_options.fused is True and tb.advantages is not None
                and not (op is not None and op.needs_whole_sequences)
                and supports_fused(output_head(self.model), logit_softcap(self.model)))

    def _fused_forward(self, tb: TrainBatch, index: torch.Tensor, plan, normalizer: float):
        """(logp (B, T) detached, entropy (B, T), values (B, T), the policy term with grad) in one chunked pass."""
        cfg, o, mask, batch = self.config, self.compute_options, tb.mask, tb.batch
        B, T = mask.shape
        hidden = self._hidden(self.model, batch, plan)  # (B, T, H)
        at = index + 1  # (N,) flat positions of the trained tokens
        pick = lambda t: t.reshape(-1).index_select(0, at)  # noqa: E731  (B, T) -> (N,)
        h, y = hidden.reshape(B * T, -1).index_select(0, index), pick(batch.input_ids)  # (N, H), (N,)
        nan = torch.full(at.shape, torch.nan, device=mask.device)
        trainer_old = pick(tb.old_logprobs) if tb.old_logprobs is not None else nan  # NaN: the current, detached
        sampled = pick(tb.sampler_logprobs) if tb.sampler_logprobs is not None else nan
        adv = pick(tb.advantages.expand(B, T)).float()
        row = torch.div(at, T, rounding_mode="floor")
        weight = pick(mask.to(torch.float32)) / max(float(normalizer), 1.0)  # token mean over the FULL batch

        def token_loss(lp, sl):  # (n,) -> (n,): elementwise in lp, everything else a constant
            told = torch.where(torch.isnan(trainer_old[sl]), lp.detach(), trainer_old[sl])
            old = ratio_old(told, sampled[sl], None, cfg.off_policy)
            tis = None if cfg.off_policy is None else correction_weights(
                cfg.off_policy, told, sampled[sl], row[sl], B, adv[sl], lp)[0]
            return ppo_token_loss(cfg, lp, old, adv[sl], tis)[0] * weight[sl]

        policy_loss, lp, ent = fused_token_loss(h, output_head(self.model), y, token_loss, temperature=tb.temperature,
                                                chunk_size=o.chunk_size, head_impl=o.head_impl,
                                                truncation=None if batch.truncation is None else batch.truncation.at(at))
        full = lambda v: torch.zeros(B * T, device=v.device).index_copy(0, at, v.float()).view(B, T)  # noqa: E731
        return full(lp), full(ent), self._values(batch, mask, hidden, plan), policy_loss

    def loss(self, tb: TrainBatch, normalizer: float | None = None) -> torch.Tensor:
        """The scalar loss of a prepared (micro-)batch (`compute(...).loss`)."""
        return self.compute(tb, normalizer).loss

    def calculate_loss(self, rollouts, rewards=None, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over `rollouts` and their (B,) rewards, or over a prepared `TrainBatch`."""
        return self.compute(as_train_batch(rollouts, rewards, self.prepare), normalizer).loss
