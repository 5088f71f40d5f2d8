"""GRPO and its variants (Dr. GRPO, DAPO, BNPO, GSPO, CISPO) as a loss that returns a tensor.

Legend: B rollouts, T tokens, N trained tokens, H hidden size. Per-token tensors are (B, T), aligned with input_ids.

    grpo = GRPO(model, tokenizer, beta=0.0, group_size=8)
    loss = grpo.calculate_loss(rollouts, rewards)      # scalar tensor; grpo.metrics records this call
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Several epochs / micro-batches over the same rollouts:

    prepared = grpo.prepare(rollouts, rewards)         # advantages, old and reference log-probs
    for _ in range(epochs):
        outs = []
        for mb in prepared.split(4):                   # each keeps the full batch's normalizer
            out = grpo.compute(mb)                     # LossOutput(loss, metrics, token_logprobs (B, T))
            out.loss.backward()                        # accumulated grads == one big batch
            outs.append(out)
        metrics = combine_metrics([o.metrics for o in outs])  # == one full-batch call's metrics
        optimizer.step(); optimizer.zero_grad()

The class is a thin front over functions you can call alone: `trainer.batch`
(encode, checks, reference log-probs), `trainer.advantages`, `model.scoring.logprobs`
and the pure loss unit `trainer.grpo_loss.grpo_loss`.
"""

from __future__ import annotations

import torch

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.model.scoring.head import logit_softcap, output_head
from SimpleTorchLLMRL.model.scoring.hidden import final_hidden_states
from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs
from SimpleTorchLLMRL.model.scoring.shared_prefix import PrefixPlan, first_positions, plan_shared_prefix
from SimpleTorchLLMRL.reward.length import OverlongPenalty
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
from SimpleTorchLLMRL.trainer.grpo_loss import GRPOConfig, LossOutput, grpo_loss, token_inputs
from SimpleTorchLLMRL.trainer.off_policy import OffPolicy
from SimpleTorchLLMRL.trainer.options import UNSET, ComputeOptions, build_options, named_options
from SimpleTorchLLMRL.utils.warn import warn_user

__all__ = ["GRPO", "GRPOConfig", "TrainBatch", "StepOutput", "LossOutput"]

_NOT_OPTIONS = frozenset({"self", "model", "tokenizer", "config", "compute", "ref_model"})


class GRPO:
    """Group-relative policy optimization over `Rollout`s; `calculate_loss` returns a scalar tensor.

    `GRPO(model, tokenizer, config=None, compute=None, **options)`, as `PPO`: options are `GRPOConfig`'s
    (the math) and `ComputeOptions`' (chunk_size, head_impl, fused, share_prefix, max_length, truncate), each a
    named keyword argument; an unknown one raises `UnknownOptionError` (a TypeError) naming it. `metrics` and `token_logprobs` record the last loss call, nothing more:
    `compute` returns them.
    """

    name = "GRPO"

    @named_options
    def __init__(self, model, tokenizer, config: GRPOConfig | None = None, compute: ComputeOptions | None = None, *,
                 ref_model=None,
                 eps: float = UNSET, eps_high: float | None = UNSET, beta: float = UNSET, loss_type: str = UNSET,
                 importance_sampling_level: str = UNSET, group_size: int | None = UNSET,
                 scale_rewards: bool | str = UNSET, temperature: float | None = UNSET,
                 advantage_estimator: str = UNSET, kl_estimator: str = UNSET, tis_cap: float | None = UNSET,
                 off_policy: OffPolicy | dict | None = UNSET, max_tokens: int | None = UNSET,
                 dual_clip: float | None = UNSET, kl_bias_correction: bool = UNSET, reward_eps: float = UNSET,
                 chunk_size: int | None = UNSET, head_impl: str = UNSET, max_length: int | None = UNSET,
                 truncate: bool = UNSET, fused: bool | None = UNSET, share_prefix: bool = UNSET):
        """config: a `GRPOConfig` (the math), compute: `ComputeOptions` (how it is computed); each keyword
        overrides its field (left out: the config's value, else the default documented there).
        ref_model: the reference policy for beta > 0 (None with a peft model: its adapter off)."""
        given = {k: v for k, v in locals().items() if k not in _NOT_OPTIONS}
        self.config, self.compute_options = build_options(self.name, GRPOConfig, config, compute, given)
        check_policy(self.name, model, tokenizer, ref_model, self.config.beta)
        self.model, self.tokenizer, self.ref_model = model, tokenizer, ref_model
        self.policy_version: int | None = None  # the trainer's current version: staleness metrics when set
        self.metrics: dict[str, float] = LazyMetrics()  # the last loss call's metrics (tensors until read)
        self.token_logprobs: torch.Tensor | None = None  # (B, T) of the last loss call, NaN where not trained
        self._dropout_checked = False

    # -- groups and advantages

    def group_index(self, rollouts: list[Rollout]) -> torch.Tensor:
        """(B,) long: group_size blocks, else metadata["group_id"], else identical prompt messages."""
        return A.rollout_groups(rollouts, self.config.group_size)

    def advantages(self, rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        """(B,) advantages of the configured estimator; singletons are pooled into one group (one warning)."""
        lonely = int((A.group_sizes(group) == 1).sum())
        if lonely:
            warn_user(f"GRPO: {lonely} of {len(group)} rollouts are alone in their group (no group_size, "
                      "group_id or shared prompt); they use the batch-wide reward baseline")
            single = A.group_sizes(group) == 1  # pool the singletons into one group (the whole batch if all)
            group = A.groups_from_keys([-1 if s else int(g) for g, s in zip(group.tolist(), single.tolist(), strict=True)])
        est = self.config.advantage_estimator
        if est == "rloo":
            return A.rloo_advantages(rewards, group)
        if est == "reinforce++":
            return A.reinforce_pp_advantages(rewards, group)
        return A.group_relative_advantages(rewards, group, self.config.scale_rewards, self.config.reward_eps)

    # -- DAPO helpers

    def filter_groups(self, rollouts: list[Rollout], rewards) -> tuple[list[Rollout], torch.Tensor]:
        """DAPO dynamic sampling: drop every group whose rewards are all equal (zero advantage, no signal)."""
        r = check_rewards(rewards, len(rollouts))
        keep = A.nonconstant_groups(r, self.group_index(rollouts))
        return [x for x, k in zip(rollouts, keep.tolist(), strict=True) if k], r[keep]

    def overlong_penalty(self, rollouts: list[Rollout], max_length: int, cache_length: int) -> torch.Tensor:
        """DAPO soft overlong punishment, (B,); add it to the rewards. A thin caller of the reward
        `reward.length.OverlongPenalty(scope="all")`: the length is every MODEL turn's generated tokens."""
        return OverlongPenalty(max_length, cache_length, scope="all", tokenizer=self.tokenizer)(list(rollouts))

    # -- the loss

    def encode(self, rollouts: list[Rollout]):
        o = self.compute_options
        return encode(self.name, rollouts, self.tokenizer, model_device(self.model), o.max_length, o.truncate)

    def logprobs(self, model, batch, mask: torch.Tensor, temperature: float) -> torch.Tensor:
        """(B, T) no-grad-able log-probs of the trained tokens under `model` (0 elsewhere)."""
        o = self.compute_options
        return token_logprobs(model, batch, temperature, o.chunk_size, positions=mask, share_prefix=o.share_prefix,
                              head_impl=o.head_impl, truncation=batch.truncation)

    def prefix_plan(self, batch, mask: torch.Tensor) -> PrefixPlan:
        """Which rows share their tokens before the first trained one (`share_prefix`); waits for the device."""
        return plan_shared_prefix(batch.input_ids, batch.attention_mask, first_positions(mask))

    def prepare(self, rollouts: list[Rollout], rewards, compute_old: bool = True) -> TrainBatch:
        """Encode, compute advantages and (no-grad) old / reference log-probs once, for several epochs."""
        cfg = self.config
        r = check_rewards(rewards, len(rollouts))
        group = self.group_index(rollouts)
        batch = self.encode(rollouts)
        mask = trained_mask(batch)
        index = trained_index(mask)  # (N,) found before any forward: the loss never waits for the device
        plan = self.prefix_plan(batch, mask) if self.compute_options.share_prefix else None
        temperature = resolve_temperature(self.name, cfg.temperature, batch.sampling_temperature)
        adv = self.advantages(r, group)
        old = ref = None
        sampled = batch.sampler_logprobs
        need_old = cfg.off_policy is not None or sampled is None or bool(torch.isnan(sampled[mask.bool()]).any())
        if compute_old and need_old:
            with torch.no_grad():
                old = self.logprobs(self.model, batch, mask, temperature)
        if cfg.beta > 0:
            ref = reference_logprobs(self.model, self.ref_model,
                                     lambda m: self.logprobs(m, batch, mask, temperature))
        metrics = {"reward_mean": r.mean().item(), "reward_std": r.std().item() if len(r) > 1 else 0.0,
                   "advantage_mean": adv.mean().item(), "advantage_abs_mean": adv.abs().mean().item(),
                   "frac_zero_advantage": (adv == 0).float().mean().item(),
                   "frac_constant_groups": 1 - A.nonconstant_groups(r, group).float().mean().item(),
                   "temperature": temperature, **staleness_metrics(rollouts, self.policy_version)}
        norm = cfg.spec.aggregator.normalizer(mask, cfg.max_tokens)
        device = batch.input_ids.device
        return TrainBatch(batch, mask, r.to(device), temperature, norm, advantages=adv.to(device),
                          old_logprobs=old, ref_logprobs=ref, metrics=metrics, token_index=index, prefix_plan=plan)

    def normalizer_for(self, rollouts: list[Rollout]) -> float:
        """The aggregator's denominator for this full batch of rollouts (for your own micro-batching)."""
        return self.config.spec.aggregator.normalizer(trained_mask(self.encode(rollouts)), self.config.max_tokens)

    def compute(self, tb: TrainBatch, normalizer: float | None = None) -> LossOutput:
        """`LossOutput(loss, metrics, token_logprobs)` of a prepared (micro-)batch; see `calculate_loss`.

        metrics: the loss unit's (`grpo_loss`) with the batch's (rewards, advantages, temperature),
        a `LazyMetrics` of tensors until read; token_logprobs (B, T), NaN where not trained.

        normalizer: the FULL batch's denominator when micro-batching yourself: sequences
        for grpo/gspo, trained tokens for dapo/bnpo/cispo, sequences x max_tokens for
        dr_grpo; `normalizer_for(rollouts)` computes it (a `split` keeps it for you)."""
        cfg, opts, mask, batch = self.config, self.compute_options, tb.mask, tb.batch
        if not self._dropout_checked:
            self._dropout_checked = warn_if_dropout(self.name, self.model)
        norm = normalizer if normalizer is not None else tb.normalizer
        index = tb.token_index if tb.token_index is not None else trained_index(mask)  # (N,) predicting positions
        plan = (tb.prefix_plan if tb.prefix_plan is not None else self.prefix_plan(batch, mask)) \
            if opts.share_prefix else None  # which rows share a prompt: found by prepare / split, before this
        hidden = final_hidden_states(self.model, batch.input_ids, batch.attention_mask, prefix_plan=plan,
                                     right_padded=True)  # (B, T, H); a Batch is right-padded
        B, T = mask.shape
        h = hidden.reshape(B * T, -1).index_select(0, index)  # (N, H): position t predicts token t+1
        y = batch.input_ids.reshape(-1).index_select(0, index + 1)  # (N,)
        out = grpo_loss(h, output_head(self.model), y, token_inputs(tb, index, norm, cfg), cfg,
                        temperature=tb.temperature, chunk_size=opts.chunk_size, softcap=logit_softcap(self.model),
                        fused=opts.fused, head_impl=opts.head_impl,
                        truncation=None if batch.truncation is None else batch.truncation.at(index + 1))
        full = torch.full((B * T,), torch.nan, device=out.token_logprobs.device)  # (B, T) flat
        full = full.index_copy(0, index + 1, out.token_logprobs.float()).view(B, T)
        metrics = LazyMetrics.merged(tb.metrics, out.metrics, temperature=tb.temperature)  # tensors until read
        self.metrics, self.token_logprobs = metrics, full  # the record of this call
        return LossOutput(out.loss, metrics, full)

    def loss(self, tb: TrainBatch, normalizer: float | None = None) -> torch.Tensor:
        """The scalar loss of a prepared (micro-)batch (`compute(...).loss`)."""
        return self.compute(tb, normalizer).loss

    def calculate_loss(self, rollouts, rewards=None, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over `rollouts` and their (B,) rewards, or over a prepared `TrainBatch`.

        normalizer: the aggregator's denominator of the FULL batch when you pass
        micro-batches yourself (see `compute`). `metrics` records this call."""
        return self.compute(as_train_batch(rollouts, rewards, self.prepare), normalizer).loss
