"""GRPO and its variants (Dr. GRPO, DAPO, BNPO, GSPO, CISPO) as a loss that returns a tensor.

Legend: B rollouts, T tokens. Per-token tensors are (B, T), aligned with input_ids.

    grpo = GRPO(model, tokenizer, beta=0.0, group_size=8)
    loss = grpo.calculate_loss(rollouts, rewards)      # scalar tensor
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Several epochs / micro-batches over the same rollouts:

    prepared = grpo.prepare(rollouts, rewards)         # advantages, old and reference log-probs
    for _ in range(epochs):
        for mb in prepared.split(4):                   # each keeps the full batch's normalizer
            grpo.calculate_loss(mb).backward()         # accumulated grads == one big batch
        optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_rollouts
from SimpleTorchLLMRL.model.logprobs import (
    DEFAULT_CHUNK_SIZE,
    final_hidden_states,
    fused_token_loss,
    logit_softcap,
    logprobs_from_hidden,
    output_head,
    supports_fused,
)
from SimpleTorchLLMRL.model.shared_prefix import first_positions
from SimpleTorchLLMRL.trainer import advantages as A
from SimpleTorchLLMRL.trainer.losses import (
    KL_ESTIMATORS,
    LOSS_TYPES,
    RATIO_LEVELS,
    Clip,
    aggregation_weights,
    default_normalizer,
)
from SimpleTorchLLMRL.trainer.rollout_batch import (
    RolloutTrainer,
    TrainBatch,
    check_rewards,
    old_and_tis,
    staleness_metrics,
    trained_mask,
)
from SimpleTorchLLMRL.utils.warn import warn_user

__all__ = ["GRPO", "GRPOConfig", "TrainBatch"]

# ---------------------------------------------------------------- GRPO


@dataclass
class GRPOConfig:
    """GRPO options; each is also a keyword argument of `GRPO`.

    loss_type: "grpo" | "dr_grpo" | "dapo" | "bnpo" | "gspo" | "cispo" (see losses.LOSS_TYPES).
    eps / eps_high: clip range [1 - eps, 1 + eps_high] (eps_high None: eps, 0.28 for dapo).
    beta: KL coefficient (kl_estimator k1 | k2 | k3); 0 skips the reference pass.
    importance_sampling_level: "token" | "sequence" (GSPO; forced by loss_type="gspo").
    group_size: consecutive blocks of G; None: metadata["group_id"], else identical prompts.
    scale_rewards: True/"group", "batch", False/"none" (Dr. GRPO uses False).
    advantage_estimator: "group" (GRPO), "rloo" or "reinforce++".
    temperature: None (default) follows the temperature the rollouts were sampled at (1.0 when none is
    recorded); a number is used when the rollouts record none (the recorded one wins, with a warning).
    tis_cap: truncated importance sampling cap (e.g. 2.0) against the sampled log-probs; None: off.
    max_tokens: Dr. GRPO's per-sequence constant, required for loss_type="dr_grpo": the generation budget
    (the generator's max_new_tokens; times the model turns for multi-turn episodes), as in the paper and
    TRL's max_completion_length. A batch-dependent constant would rescale the loss from batch to batch.
    kl_bias_correction: multiply the per-token KL by the importance ratio pi/pi_old (DeepSeek-V3.2; TRL's
    use_bias_correction_kl), which makes the k3 estimate unbiased for off-policy tokens.
    dual_clip: c > 1 caps the loss of negative advantages at -c A (None: off).
    fused: compute token-level losses with `fused_token_loss` when the head allows (same values and
    gradients, one matmul fewer); False always uses chunked log-probs + autograd.
    share_prefix: the rows of a group run their shared prompt once (a KV-cached prefix forward, then
    each row's completion against it; `model.shared_prefix`), in the loss and the no-grad log-prob
    passes. Same log-probs and gradients up to float summation order, checked against the plain
    forward once per model; it saves the prompt's compute and activations G - 1 times per group.
    """

    eps: float = 0.2
    eps_high: float | None = None
    beta: float = 0.0
    loss_type: str = "grpo"
    importance_sampling_level: str = "token"
    group_size: int | None = None
    scale_rewards: bool | str = True
    temperature: float | None = None
    advantage_estimator: str = "group"
    kl_estimator: str = "k3"
    tis_cap: float | None = None
    max_tokens: int | None = None
    dual_clip: float | None = None
    kl_bias_correction: bool = False
    reward_eps: float = 1e-4
    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_length: int | None = None
    truncate: bool = False
    fused: bool = True
    share_prefix: bool = False

    def __post_init__(self):
        def bad(name, allowed):
            raise ValueError(f"GRPO {name}={getattr(self, name)!r} is invalid; expected {allowed}")

        if self.loss_type not in LOSS_TYPES:
            bad("loss_type", f"one of {sorted(LOSS_TYPES)}")
        if self.importance_sampling_level not in RATIO_LEVELS:
            bad("importance_sampling_level", f"one of {RATIO_LEVELS}")
        if self.advantage_estimator not in A.ADVANTAGE_ESTIMATORS:
            bad("advantage_estimator", f"one of {A.ADVANTAGE_ESTIMATORS}")
        if self.kl_estimator not in KL_ESTIMATORS:
            bad("kl_estimator", f"one of {sorted(KL_ESTIMATORS)}")
        if self.scale_rewards not in (True, False, "group", "batch", "none"):
            bad("scale_rewards", "True, False, 'group', 'batch' or 'none'")
        for name, ok, allowed in [
            ("beta", self.beta >= 0, ">= 0"), ("temperature", self.temperature is None or self.temperature > 0, "None or > 0"),
            ("group_size", self.group_size is None or self.group_size >= 1, "None or an int >= 1"),
            ("tis_cap", self.tis_cap is None or self.tis_cap > 0, "None or > 0"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "None or an int >= 1"),
            ("chunk_size", self.chunk_size >= 1, "an int >= 1"), ("reward_eps", self.reward_eps >= 0, ">= 0"),
        ]:
            if not ok:
                bad(name, allowed)
        if self.loss_type == "dr_grpo" and self.max_tokens is None:
            raise ValueError("GRPO loss_type='dr_grpo' needs max_tokens=: its fixed per-sequence constant, the "
                             "generation budget (your generator's max_new_tokens, times the model turns for "
                             "multi-turn episodes)")
        spec = LOSS_TYPES[self.loss_type]
        if self.eps_high is None:
            self.eps_high = spec.default_eps_high if spec.default_eps_high is not None else self.eps
        self.clip = Clip(self.eps, self.eps_high, self.dual_clip)  # raises on eps / eps_high / dual_clip

    @property
    def spec(self):
        return LOSS_TYPES[self.loss_type]

    @property
    def ratio_level(self) -> str:
        return self.spec.ratio_level or self.importance_sampling_level


@dataclass
class TokenInputs:
    """The per-token constants of GRPO's loss, each (N,) over the batch's N trained tokens."""

    advantages: torch.Tensor  # the rollout's advantage, repeated on each of its tokens
    trainer_old: torch.Tensor  # old log-probs recomputed by the trainer (NaN: not computed, on-policy)
    sampled: torch.Tensor  # the generator's log-probs (NaN where unknown)
    ref: torch.Tensor | None  # reference log-probs (None when beta == 0)
    weight: torch.Tensor  # the aggregator's weight of each token (normalizer included)
    row: torch.Tensor  # long: the rollout each token belongs to
    rows: int  # B


class GRPO(RolloutTrainer):
    """Group-relative policy optimization over `Rollout`s; `calculate_loss` returns a scalar tensor."""

    name = "GRPO"

    def __init__(self, model, tokenizer, eps: float = 0.2, eps_high: float | None = None, beta: float = 0.0,
                 ref_model=None, loss_type: str = "grpo", importance_sampling_level: str = "token",
                 group_size: int | None = None, scale_rewards: bool | str = True, temperature: float | None = None,
                 **options):
        allowed = {f.name for f in fields(GRPOConfig)}
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise ValueError(f"GRPO got unknown options {unknown}; allowed: {sorted(allowed)}")
        config = GRPOConfig(eps=eps, eps_high=eps_high, beta=beta, loss_type=loss_type,
                            importance_sampling_level=importance_sampling_level, group_size=group_size,
                            scale_rewards=scale_rewards, temperature=temperature, **options)
        super().__init__(model, tokenizer, config, ref_model)

    # -- groups and advantages

    def group_index(self, rollouts: list[Rollout]) -> torch.Tensor:
        """(B,) long: group_size blocks, else metadata["group_id"], else identical prompt messages."""
        if self.config.group_size is not None:
            return A.groups_from_size(len(rollouts), self.config.group_size)
        ids = [r.metadata.get("group_id") for r in rollouts]
        if all(i is not None for i in ids):
            return A.groups_from_keys(ids)
        if any(i is not None for i in ids):
            missing = [k for k, i in enumerate(ids) if i is None]
            raise ValueError(f"metadata['group_id'] is set on some rollouts but not on rollouts {missing[:10]}")
        return A.groups_from_keys([tuple((m.role, m.name, m.content) for m in r.prompt_messages) for r in rollouts])

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
        """DAPO soft overlong punishment from each rollout's trained-token count, (B,); add it to the rewards."""
        enc = encode_rollouts(list(rollouts), self.tokenizer)
        return A.overlong_penalty(torch.tensor([sum(e.loss_mask) for e in enc]), max_length, cache_length)

    # -- the loss

    def prepare(self, rollouts: list[Rollout], rewards, compute_old: bool = True) -> TrainBatch:
        """Encode, compute advantages and (no-grad) old / reference log-probs once, for several epochs."""
        r = check_rewards(rewards, len(rollouts))
        group = self.group_index(rollouts)
        batch = self.encode(rollouts)
        mask = trained_mask(batch)
        temperature = self.resolve_temperature(batch)
        adv = self.advantages(r, group)
        old = None
        sampled = batch.old_logprobs
        need_old = self.config.tis_cap is not None or sampled is None or bool(torch.isnan(sampled[mask.bool()]).any())
        if compute_old and need_old:
            with torch.no_grad():
                old = self.logprobs(self.model, batch, mask, temperature)
        metrics = {"reward_mean": r.mean().item(), "reward_std": r.std().item() if len(r) > 1 else 0.0,
                   "advantage_mean": adv.mean().item(), "advantage_abs_mean": adv.abs().mean().item(),
                   "frac_zero_advantage": (adv == 0).float().mean().item(),
                   "frac_constant_groups": 1 - A.nonconstant_groups(r, group).float().mean().item(),
                   **staleness_metrics(rollouts, self.policy_version)}
        norm = default_normalizer(self.config.spec.aggregate, mask, self.config.max_tokens)
        device = batch.input_ids.device
        return TrainBatch(batch, mask, r.to(device), temperature, norm, advantages=adv.to(device),
                          old_logprobs=old, ref_logprobs=self.reference_logprobs(batch, mask, temperature),
                          metrics=metrics)

    def normalizer_for(self, rollouts: list[Rollout]) -> float:
        """The aggregator's denominator for this full batch of rollouts (for your own micro-batching)."""
        return default_normalizer(self.config.spec.aggregate, trained_mask(self.encode(rollouts)),
                                  self.config.max_tokens)

    def loss(self, tb: TrainBatch, normalizer: float | None = None) -> torch.Tensor:
        """The scalar loss of a prepared (micro-)batch; see `calculate_loss`.

        normalizer: the FULL batch's denominator when micro-batching yourself: sequences
        for grpo/gspo, trained tokens for dapo/bnpo/cispo, sequences x max_tokens for
        dr_grpo; `normalizer_for(rollouts)` computes it."""
        cfg, mask, batch = self.config, tb.mask, tb.batch
        self.check_dropout()
        norm = normalizer if normalizer is not None else tb.normalizer
        start = first_positions(mask) if cfg.share_prefix else None  # (B,) first hidden state a row needs
        hidden = final_hidden_states(self.model, batch.input_ids, batch.attention_mask, start=start)  # (B, T, H)
        select = mask[:, 1:].bool()  # (B, T-1): token t+1 is trained, predicted from position t
        h, y = hidden[:, :-1][select], batch.input_ids[:, 1:][select]  # (N, H), (N,)
        x = self._token_inputs(tb, select, norm)
        head, softcap = output_head(self.model), logit_softcap(self.model)
        opts = dict(temperature=tb.temperature, chunk_size=cfg.chunk_size)
        if cfg.fused and cfg.ratio_level == "token" and supports_fused(head, softcap):
            loss, logp, entropy = fused_token_loss(h, head, y, lambda lp, sl: self._token_terms(x, lp, sl)[0],
                                                   **opts)
        else:
            logp, entropy = logprobs_from_hidden(h, head, y, softcap=softcap, **opts)
            loss = self._token_terms(x, logp, slice(None))[0].sum()
            logp = logp.detach()
        self.metrics = self._metrics(tb, loss, x, logp, entropy)
        full = torch.full(mask.shape, torch.nan, device=logp.device)  # (B, T)
        full[:, 1:][select] = logp.detach().float()
        self.token_logprobs = full  # the recomputed log-prob of each trained token, for `logprob_drift`
        return loss

    def _token_inputs(self, tb: TrainBatch, select: torch.Tensor, normalizer: float) -> TokenInputs:
        """Constants of the per-token loss over the trained tokens. NaN trainer_old = the current policy."""
        mask = tb.mask
        pick = lambda t: t[:, 1:][select]  # noqa: E731  (B, T) -> (N,)
        nan = torch.full(mask.shape, torch.nan, device=mask.device)
        B = mask.shape[0]
        return TokenInputs(
            advantages=pick(tb.advantages[:, None].expand_as(mask).float()),
            trainer_old=pick(tb.old_logprobs if tb.old_logprobs is not None else nan),
            sampled=pick(tb.batch.old_logprobs if tb.batch.old_logprobs is not None else nan),
            ref=pick(tb.ref_logprobs) if tb.ref_logprobs is not None else None,
            weight=pick(aggregation_weights(self.config.spec.aggregate, mask, normalizer)),
            row=pick(torch.arange(B, device=mask.device)[:, None].expand_as(mask)),
            rows=B,
        )

    def _token_terms(self, x: TokenInputs, lp: torch.Tensor, sl: slice):
        """(weighted per-token loss (n,), stats) for the trained tokens `sl`, from their log-probs lp (n,)."""
        cfg = self.config
        trainer_old = torch.where(torch.isnan(x.trainer_old[sl]), lp.detach(), x.trainer_old[sl])
        old, tis = old_and_tis(trainer_old, x.sampled[sl], None, cfg.tis_cap)  # as PPO decides it
        if cfg.ratio_level == "sequence":  # GSPO: one length-normalized ratio per rollout (needs every token)
            row, n = x.row, x.rows
            count = torch.zeros(n, device=lp.device).index_add_(0, row, torch.ones_like(lp))
            log_ratio = (torch.zeros(n, device=lp.device).index_add(0, row, lp - old) / count.clamp(min=1))[row]
        else:
            log_ratio = lp - old
        loss, stats = cfg.spec.policy_loss(log_ratio, lp, x.advantages[sl], cfg.clip)
        stats["log_ratio"] = log_ratio
        if tis is not None:
            stats["tis"] = tis
            loss = loss * tis
        if cfg.beta > 0:
            stats["kl"] = KL_ESTIMATORS[cfg.kl_estimator](lp, x.ref[sl])
            kl = stats["kl"] * torch.exp(log_ratio) if cfg.kl_bias_correction else stats["kl"]
            loss = loss + cfg.beta * kl
        return loss * x.weight[sl], stats

    @torch.no_grad()
    def _metrics(self, tb, loss, x, logp, entropy) -> dict[str, float]:
        _, st = self._token_terms(x, logp, slice(None))
        ratio = torch.exp(st["log_ratio"])
        mean = lambda t: t.float().mean().item()  # noqa: E731
        out = dict(tb.metrics)
        out.update(loss=loss.item(), entropy=mean(entropy), ratio_mean=mean(ratio), ratio_min=ratio.min().item(),
                   ratio_max=ratio.max().item(), clip_frac_low=mean(st["clipped_low"]),
                   clip_frac_high=mean(st["clipped_high"]), num_tokens=int(logp.numel()), num_sequences=len(tb),
                   temperature=tb.temperature)
        out["clip_frac"] = out["clip_frac_low"] + out["clip_frac_high"]
        for key in ("kl", "tis"):
            if key in st:
                out["kl" if key == "kl" else "tis_weight_mean"] = mean(st[key])
        return out
