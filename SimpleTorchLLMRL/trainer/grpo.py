"""GRPO and its variants (Dr. GRPO, DAPO, BNPO, GSPO, CISPO): group-relative advantages, the loss unit, the front.

Legend: B rollouts, T tokens, N trained tokens, G group size.

    grpo = GRPO(model, tokenizer, beta=0.0, group_size=8)
    loss = grpo.calculate_loss(rollouts, rewards)      # scalar tensor; grpo.metrics records this call
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Several epochs / micro-batches over the same rollouts:

    prepared = grpo.prepare(rollouts, rewards)         # advantages, old and reference log-probs, once
    for mb in prepared.split(4):                       # each keeps the full batch's normalizer
        out = grpo.compute(mb)                         # LossOutput(loss, metrics, token_logprobs (B, T))
        out.loss.backward()                            # accumulated grads == one big batch

The loss unit `grpo_loss(inputs, config)` is pure; `reference.grpo_reference` is the default loss
on one screen of plain torch (the readable definition, tested equal to this one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.model.dropout import warn_if_dropout
from SimpleTorchLLMRL.reward.length import OverlongPenalty
from SimpleTorchLLMRL.trainer import losses as L
from SimpleTorchLLMRL.trainer import off_policy as O
from SimpleTorchLLMRL.trainer import pipeline as P
from SimpleTorchLLMRL.trainer.options import ComputeOptions, build_options, front_options
from SimpleTorchLLMRL.utils.warn import warn_user

# ---------------------------------------------------------------- group-relative advantages (pure)


def _group_mean(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    n = torch.bincount(group).to(x.dtype)  # (groups,)
    return (torch.zeros_like(n).index_add_(0, group, x) / n)[group]  # (B,)


def _group_std(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Unbiased per-group std, 0 for a group of one, (B,)."""
    n = torch.bincount(group).to(x.dtype)
    ss = torch.zeros_like(n).index_add_(0, group, (x - _group_mean(x, group)) ** 2)
    return torch.sqrt(ss / (n - 1).clamp(min=1))[group]


def group_relative_advantages(rewards: torch.Tensor, group: torch.Tensor, scale: bool | str = True,
                              eps: float = 1e-4) -> torch.Tensor:
    """GRPO: (r - mean_group) / (std_group + eps), (B,). scale: True / "group" the group's unbiased std,
    "batch" the batch's, False / "none" none (Dr. GRPO). An all-equal group gets 0; a rollout alone in
    its group uses the batch-wide mean and std."""
    r = rewards.to(torch.float64)
    single = P.group_sizes(group) == 1  # (B,)
    centered = r - torch.where(single, r.mean(), _group_mean(r, group))
    batch_std = r.std() if r.numel() > 1 else r.new_zeros(())
    if scale is True or scale == "group":
        std = torch.where(single, batch_std, _group_std(r, group))
    elif scale == "batch":
        std = batch_std.expand_as(r)
    elif scale is False or scale == "none":
        return centered.to(rewards.dtype)
    else:
        raise ValueError(f"scale_rewards must be True, False, 'group', 'batch' or 'none', got {scale!r}")
    return (centered / (std + eps)).to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i - mean of the OTHER rollouts of the group, (B,); 0 for a group of one."""
    r = rewards.to(torch.float64)
    n = P.group_sizes(group).to(r.dtype)
    sums = torch.zeros(int(group.max()) + 1, dtype=r.dtype).index_add_(0, group, r)[group]
    return torch.where(n > 1, r - (sums - r) / (n - 1).clamp(min=1), torch.zeros_like(r)).to(rewards.dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor | None = None, shift_mean: bool = True,
           eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the entries where mask is set (all by default), 0 elsewhere; no host sync."""
    m = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    w, x64 = m.to(torch.float64), x.to(torch.float64)
    n = w.sum()
    mean = (x64 * w).sum() / n.clamp(min=1)
    var = ((x64 - mean) ** 2 * w).sum() / (n - 1).clamp(min=1)  # unbiased, as torch.std
    out = (x64 - mean) / (torch.where(n > 1, var.sqrt(), torch.zeros_like(var)) + eps)
    return torch.where(m, (out if shift_mean else out + mean).to(x.dtype), torch.zeros_like(x))


def reinforce_pp_advantages(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the batch, (B,)."""
    return whiten(group_relative_advantages(rewards, group, scale=False))


def nonconstant_groups(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: (B,) bool, True for rollouts whose group's rewards are not all equal."""
    r, ng = rewards.to(torch.float64), int(group.max()) + 1
    hi = torch.full((ng,), -torch.inf, dtype=r.dtype).scatter_reduce(0, group, r, "amax")
    lo = torch.full((ng,), torch.inf, dtype=r.dtype).scatter_reduce(0, group, r, "amin")
    return (hi > lo)[group]


ADVANTAGE_ESTIMATORS = ("group", "rloo", "reinforce++")

# ---------------------------------------------------------------- the loss unit


def sequence_log_ratio(log_ratio: torch.Tensor, row: torch.Tensor, rows: int) -> torch.Tensor:
    """GSPO: each rollout's mean_t (log pi - log pi_old) on each of its (n,) tokens (gradient 1 / |rollout| each)."""
    n = L.per_row(torch.ones_like(log_ratio), row, rows).clamp(min=1)  # (B,)
    return (L.per_row(log_ratio, row, rows) / n).index_select(0, row)


def cispo_loss(log_ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, clip: L.Clip):
    """CISPO (MiniMax-M1): -sg(min(r, 1+high)) A log pi; every token keeps its gradient through log pi."""
    ratio = torch.exp(log_ratio)
    loss = -torch.clamp(ratio, max=1 + clip.high).detach() * adv * logp
    return loss, {"clipped_low": torch.zeros_like(ratio, dtype=torch.bool), "clipped_high": ratio > 1 + clip.high}


class LossSpec(NamedTuple):
    """A GRPO-family variant: its per-token policy loss, aggregate, forced ratio level and default eps_high."""

    policy_loss: Callable
    aggregate: str
    ratio_level: str | None = None
    default_eps_high: float | None = None


LOSS_TYPES: dict[str, LossSpec] = {
    "grpo": LossSpec(L.clipped_surrogate, "sequence_mean_token_mean"),
    "bnpo": LossSpec(L.clipped_surrogate, "token_mean"),
    "dapo": LossSpec(L.clipped_surrogate, "token_mean", default_eps_high=0.28),
    "dr_grpo": LossSpec(L.clipped_surrogate, "token_sum_constant"),
    "gspo": LossSpec(L.clipped_surrogate, "sequence_mean_token_mean", ratio_level="sequence"),
    "cispo": LossSpec(cispo_loss, "token_mean"),
}
RATIO_LEVELS = ("token", "sequence")


@dataclass
class GRPOConfig:
    """The options that change GRPO's math; each is also a keyword argument of `GRPO`."""

    eps: float = 0.2
    """The ratio is clipped to [1 - eps, 1 + eps_high]."""
    eps_high: float | None = None
    """The clip's upper width (None: eps; 0.28 for "dapo"); CISPO's cap is 1 + eps_high."""
    beta: float = 0.0
    """Weight of the per-token KL to the reference (0: no reference pass)."""
    loss_type: str = "grpo"
    """"grpo" | "dr_grpo" | "dapo" | "bnpo" | "gspo" | "cispo": a policy loss, ratio level and aggregate
    (`LOSS_TYPES`)."""
    importance_sampling_level: str = "token"
    """"token" or "sequence" (GSPO's length-normalized sequence ratio; forced by loss_type="gspo")."""
    group_size: int | None = None
    """Consecutive blocks of G rollouts form a group (None: metadata["group_id"], else identical prompts)."""
    scale_rewards: bool | str = True
    """Divide advantages by the group's std (True / "group"), the batch's ("batch") or not (False / "none")."""
    temperature: float | None = None
    """None follows the temperature the rollouts were sampled at (1.0 when none is recorded); a number is used
    when the rollouts record none (the recorded one wins, with a warning)."""
    advantage_estimator: str = "group"
    """"group" (GRPO), "rloo" or "reinforce++"."""
    kl_estimator: str = "k3"
    """"k1" | "k2" | "k3": the estimator of the per-token KL to the reference."""
    off_policy: O.OffPolicy | dict | None = None
    """An `OffPolicy` (or a dict of its fields): the correction between the trainer's and the sampler's
    log-probs (`trainer.off_policy`); the ratio then uses the trainer's own old log-probs."""
    max_tokens: int | None = None
    """Dr. GRPO's per-sequence constant, required for "dr_grpo": the generation budget (max_new_tokens, times
    the model turns of multi-turn episodes), as TRL's max_completion_length."""
    dual_clip: float | None = None
    """c > 1 caps the loss of negative advantages at -c A (None: off)."""
    kl_bias_correction: bool = False
    """Multiply the per-token KL by the ratio pi / pi_old (DeepSeek-V3.2; TRL's use_bias_correction_kl)."""
    reward_eps: float = 1e-4
    """The floor added to the std that divides the advantages."""

    def __post_init__(self):
        def bad(name, allowed):
            raise ValueError(f"GRPO {name}={getattr(self, name)!r} is invalid; expected {allowed}")

        for name, ok, allowed in [
            ("loss_type", self.loss_type in LOSS_TYPES, f"one of {sorted(LOSS_TYPES)}"),
            ("importance_sampling_level", self.importance_sampling_level in RATIO_LEVELS, f"one of {RATIO_LEVELS}"),
            ("advantage_estimator", self.advantage_estimator in ADVANTAGE_ESTIMATORS,
             f"one of {ADVANTAGE_ESTIMATORS}"),
            ("kl_estimator", self.kl_estimator in L.KL_ESTIMATORS, f"one of {sorted(L.KL_ESTIMATORS)}"),
            ("scale_rewards", self.scale_rewards in (True, False, "group", "batch", "none"),
             "True, False, 'group', 'batch' or 'none'"),
            ("beta", self.beta >= 0, ">= 0"), ("reward_eps", self.reward_eps >= 0, ">= 0"),
            ("temperature", self.temperature is None or self.temperature > 0, "None or > 0"),
            ("group_size", self.group_size is None or self.group_size >= 1, "None or an int >= 1"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "None or an int >= 1"),
        ]:
            if not ok:
                bad(name, allowed)
        if self.loss_type == "dr_grpo" and self.max_tokens is None:
            raise ValueError("GRPO loss_type='dr_grpo' needs max_tokens=: its fixed per-sequence constant, the "
                             "generation budget (your generator's max_new_tokens, times the model turns for "
                             "multi-turn episodes)")
        self.off_policy = O.as_off_policy("GRPO", self.off_policy)
        if self.eps_high is None:
            self.eps_high = self.spec.default_eps_high if self.spec.default_eps_high is not None else self.eps
        self.clip = L.Clip(self.eps, self.eps_high, self.dual_clip)  # raises on eps / eps_high / dual_clip

    spec = property(lambda self: LOSS_TYPES[self.loss_type])
    ratio_level = property(lambda self: self.spec.ratio_level or self.importance_sampling_level)

    @property
    def token_level(self) -> bool:
        """Whether each token's loss depends on its own log-prob alone (the fused head may form its gradient)."""
        op = self.off_policy
        return self.ratio_level == "token" and not (op is not None and op.needs_whole_sequences)


def grpo_loss(inputs: L.LossInputs, config: GRPOConfig) -> L.LossOutput:
    """The GRPO family's loss of the trained tokens: the policy loss of `config.loss_type` (times the
    off-policy weight) + beta x KL, aggregated; `LossOutput(loss, metrics, token_logprobs (N,))`."""
    lp, x, op = inputs.logprobs, inputs, config.off_policy
    sampled = x.sampler_logprobs if x.sampler_logprobs is not None else torch.full_like(lp, torch.nan).detach()
    old, trainer_old = L.old_logprobs(lp, x.old_logprobs, x.sampler_logprobs, op)
    log_ratio = lp - old
    if config.ratio_level == "sequence":  # GSPO: one length-normalized ratio per rollout
        log_ratio = sequence_log_ratio(log_ratio, x.row, x.rows)
    per_token, flags = config.spec.policy_loss(log_ratio, lp, x.advantages, config.clip)
    metrics = {}
    if op is not None:
        tis, correction = O.correction_weights(op, trainer_old, sampled, x.row, x.rows, x.advantages, lp)
        per_token = per_token * tis
        metrics.update(O.correction_metrics(tis, correction))
    if config.beta > 0:
        kl = L.KL_ESTIMATORS[config.kl_estimator](lp, x.ref_logprobs)
        metrics["kl"] = (kl.detach().mean(), L.TOKEN_MEAN)
        per_token = per_token + config.beta * (kl * torch.exp(log_ratio) if config.kl_bias_correction else kl)
    loss = (per_token * L.weights(config.spec.aggregate, x, config.max_tokens)).sum()
    with torch.no_grad():
        metrics.update(loss=(loss.detach(), L.SUM), num_tokens=(L.count(x.num_tokens, lp), L.SUM),
                       num_sequences=(L.count(x.rows, lp), L.SUM), **L.ratio_metrics(torch.exp(log_ratio.detach()), flags))
        if x.entropy is not None:
            metrics["entropy"] = (x.entropy.detach().float().mean(), L.TOKEN_MEAN)
        if x.sampler_logprobs is not None:  # KL / chi-square / ESS / perplexity ratio, sampler vs trainer
            metrics.update(L.mismatch_metrics(trainer_old, sampled, x.row, x.rows))
    return L.LossOutput(loss, L.LazyMetrics.of(**metrics), lp.detach())


# ---------------------------------------------------------------- the front


@front_options(GRPOConfig)
class GRPO:
    """Group-relative policy optimization over `Rollout`s; `calculate_loss` returns a scalar tensor.

    Options: `GRPOConfig`'s (the math) and `ComputeOptions`' (how it is computed), each a keyword argument
    overriding `config`'s or `compute`'s field; ref_model: the reference for beta > 0 (None with a peft
    model: its adapter off). `metrics` and `token_logprobs` record the last loss call; `compute` returns them.
    """

    name = "GRPO"

    def __init__(self, model, tokenizer, config: GRPOConfig | None = None, compute: ComputeOptions | None = None,
                 *, ref_model=None, **options):
        self.config, self.compute_options = build_options(type(self), config, compute, options)
        P.check_policy(self.name, model, tokenizer, ref_model, self.config.beta)
        self.model, self.tokenizer, self.ref_model = model, tokenizer, ref_model
        self.policy_version: int | None = None  # the trainer's current version: staleness metrics when set
        self.metrics: dict = L.LazyMetrics()  # the last loss call's metrics (tensors until read)
        self.token_logprobs: torch.Tensor | None = None  # (B, T) of the last loss call, NaN where not trained
        self._dropout_checked = False

    def group_index(self, rollouts: list[Rollout]) -> torch.Tensor:
        """(B,) long: group_size blocks, else metadata["group_id"], else identical prompt messages."""
        return P.rollout_groups(rollouts, self.config.group_size)

    def advantages(self, rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        """(B,) advantages of the configured estimator; singletons are pooled into one group (one warning)."""
        single = P.group_sizes(group) == 1
        if bool(single.any()):
            warn_user(f"GRPO: {int(single.sum())} of {len(group)} rollouts are alone in their group (no group_size, "
                      "group_id or shared prompt); they use the batch-wide reward baseline")
            group = P.groups_from_keys([-1 if s else int(g) for g, s in zip(group.tolist(), single.tolist(),
                                                                            strict=True)])
        est, cfg = self.config.advantage_estimator, self.config
        if est == "rloo":
            return rloo_advantages(rewards, group)
        if est == "reinforce++":
            return reinforce_pp_advantages(rewards, group)
        return group_relative_advantages(rewards, group, cfg.scale_rewards, cfg.reward_eps)

    def filter_groups(self, rollouts: list[Rollout], rewards) -> tuple[list[Rollout], torch.Tensor]:
        """DAPO dynamic sampling: drop every group whose rewards are all equal (zero advantage, no signal)."""
        r = P.check_rewards(rewards, len(rollouts))
        keep = nonconstant_groups(r, self.group_index(rollouts))
        return [x for x, k in zip(rollouts, keep.tolist(), strict=True) if k], r[keep]

    def overlong_penalty(self, rollouts: list[Rollout], max_length: int, cache_length: int) -> torch.Tensor:
        """DAPO soft overlong punishment, (B,), to add to the rewards: `OverlongPenalty(scope="all")`."""
        return OverlongPenalty(max_length, cache_length, scope="all", tokenizer=self.tokenizer)(list(rollouts))

    def normalizer_for(self, rollouts: list[Rollout]) -> float:
        """The aggregate's denominator of this full batch of rollouts (for your own micro-batching)."""
        batch = P.encode(self.name, rollouts, self.tokenizer, self.model, self.compute_options)
        return L.normalizer(self.config.spec.aggregate, P.trained_mask(batch), self.config.max_tokens)

    def prepare(self, rollouts: list[Rollout], rewards, compute_old: bool = True) -> P.TrainBatch:
        """Encode, compute advantages and (no-grad) old / reference log-probs once, for several epochs."""
        cfg, opts = self.config, self.compute_options
        tb = P.train_batch(self.name, self.model, self.tokenizer, rollouts, opts, temperature=cfg.temperature,
                           rewards=rewards, normalizer=lambda m: L.normalizer(cfg.spec.aggregate, m, cfg.max_tokens),
                           metrics=P.staleness_metrics(rollouts, self.policy_version))
        r, group = tb.rewards.cpu(), self.group_index(rollouts)
        adv = self.advantages(r, group)
        tb.advantages, tb.group = adv.to(tb.mask.device), group.to(tb.mask.device)
        if compute_old and L.needs_old_pass(tb.sampler_logprobs, tb.mask, cfg.off_policy):
            tb.old_logprobs = P.logprobs_pass(self.model, tb, opts)
        if cfg.beta > 0:
            tb.ref_logprobs = P.reference_logprobs(self.model, self.ref_model, tb, opts)
        tb.metrics.update(reward_mean=r.mean().item(), reward_std=r.std().item() if len(r) > 1 else 0.0,
                          advantage_mean=adv.mean().item(), advantage_abs_mean=adv.abs().mean().item(),
                          frac_zero_advantage=(adv == 0).float().mean().item(),
                          frac_constant_groups=1 - nonconstant_groups(r, group).float().mean().item())
        return tb

    def compute(self, tb: P.TrainBatch, normalizer: float | None = None) -> L.LossOutput:
        """`LossOutput(loss, metrics, token_logprobs)` of a prepared (micro-)batch: metrics `grpo_loss`'s and the
        batch's (a `LazyMetrics`, tensors until read), token_logprobs (B, T), NaN where not trained.
        normalizer: the FULL batch's denominator when micro-batching yourself (a `split` keeps it)."""
        if self.model.training and not self._dropout_checked:  # once, when it trains
            self._dropout_checked = warn_if_dropout(self.name, self.model)
        out = P.run_unit(grpo_loss, self.config, self.model, tb, self.compute_options, normalizer)
        self.metrics, self.token_logprobs = out.metrics, out.token_logprobs  # the record of this call
        return out

    def calculate_loss(self, rollouts, rewards=None, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over `rollouts` and their (B,) rewards, or over a prepared `TrainBatch`."""
        return self.compute(P.as_train_batch(rollouts, rewards, self.prepare), normalizer).loss
