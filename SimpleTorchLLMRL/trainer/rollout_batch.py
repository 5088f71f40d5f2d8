"""Shared plumbing of the rollout trainers (GRPO, PPO): rollouts -> device batch, checks, old / reference log-probs.

Legend: B rollouts, T tokens. Per-token tensors are (B, T), aligned with input_ids.
`TrainBatch` carries everything a loss needs and splits into micro-batches
that keep the full batch's normalizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from SimpleTorchLLMRL.chat.message import Rollout, sampled_versions
from SimpleTorchLLMRL.chat.tokenize import Batch, rollouts_to_batch
from SimpleTorchLLMRL.model.adapters import use_adapter
from SimpleTorchLLMRL.model.dropout import active_dropout
from SimpleTorchLLMRL.model.logprobs import check_vocabulary, token_logprobs
from SimpleTorchLLMRL.model.lora import is_peft_model
from SimpleTorchLLMRL.trainer.losses import truncated_is_weight
from SimpleTorchLLMRL.utils.warn import warn_user


def check_rewards(rewards, num_rollouts: int) -> torch.Tensor:
    """Rewards as a (B,) float32 CPU tensor; ValueError on a length mismatch or NaN / inf."""
    r = torch.as_tensor(rewards, dtype=torch.float32).detach().cpu()
    if r.dim() == 2 and r.shape[1] == 1:
        r = r[:, 0]
    if r.dim() != 1 or r.shape[0] != num_rollouts:
        raise ValueError(f"rewards has shape {tuple(r.shape)} but there are {num_rollouts} rollouts; "
                         f"expected one reward per rollout, shape ({num_rollouts},)")
    bad = (~torch.isfinite(r)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"rewards must be finite; rollouts {bad[:10]} have {r[bad[:10]].tolist()}")
    return r


def trained_mask(batch: Batch) -> torch.Tensor:
    """loss_mask without column 0 (nothing predicts the first token), (B, T); every row must train something."""
    mask = batch.loss_mask.clone()
    mask[:, 0] = 0
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rollouts {empty[:10]} have no trainable token (no trainable MODEL message after "
                         "the first token); drop them or mark a message trainable=True")
    return mask


def staleness_metrics(rollouts: list[Rollout], current: int | None) -> dict[str, float]:
    """Versions behind the current policy of the sampled turns: mean and max (empty without versions)."""
    versions = sampled_versions(rollouts)
    if current is None or not versions:
        return {}
    behind = [current - v for v in versions]
    return {"staleness_mean": sum(behind) / len(behind), "staleness_max": float(max(behind))}


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def old_and_tis(trainer_old: torch.Tensor, sampled: torch.Tensor | None, mask: torch.Tensor | None,
                tis_cap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Old log-probs for the ratio, and the TIS weight (None without tis_cap), both shaped as `trainer_old`.

    The one place GRPO and PPO decide what "old" means. Without TIS the generator's sampled
    log-probs are the old policy where known (the trainer's recomputed ones elsewhere). With
    TIS the ratio uses the trainer's recomputed log-probs and min(pi_trainer / pi_sampler, cap)
    reweights each token. Positions outside `mask` (None: every position is trained) get finite
    values so nothing NaN reaches the graph. Works on (B, T) and on (N,) trained tokens alike.
    """
    m = torch.ones_like(trainer_old, dtype=torch.bool) if mask is None else mask.bool()
    if sampled is None:
        return torch.where(m, trainer_old, 0.0), None
    known = m & ~torch.isnan(sampled)
    if tis_cap is None:
        return torch.where(known, sampled, torch.where(m, trainer_old, 0.0)), None
    weight = truncated_is_weight(trainer_old, torch.where(known, sampled, torch.nan), tis_cap)
    return torch.where(m, trainer_old, 0.0), weight


def _cut(t: torch.Tensor | None, rows: slice, T: int) -> torch.Tensor | None:
    """Rows of a (B,) or (B, T) tensor, the latter cut to its first T columns."""
    if t is None:
        return None
    return t[rows, :T] if t.dim() == 2 else t[rows]


@dataclass
class TrainBatch:
    """Everything a loss needs for one (micro-)batch. Tensors are on the model's device.

    advantages: (B,) for GRPO, (B, T) for PPO, or None (PPO computes them from its values).
    old_logprobs / ref_logprobs / old_values / returns: (B, T) or None (None old_logprobs:
    the current policy, detached, i.e. on-policy). normalizer: the FULL batch's denominator.
    """

    batch: Batch
    mask: torch.Tensor
    rewards: torch.Tensor
    temperature: float
    normalizer: float
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    metrics: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.batch)

    def split(self, micro_batch_size: int) -> list[TrainBatch]:
        """Row slices of at most `micro_batch_size`, trimmed of all-padding columns."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        out = []
        for s in range(0, len(self), micro_batch_size):
            rows = slice(s, s + micro_batch_size)
            T = int(self.batch.attention_mask[rows].sum(-1).max())
            b = self.batch[rows].columns(T)
            out.append(replace(self, batch=b, mask=_cut(self.mask, rows, T), rewards=self.rewards[rows],
                               advantages=_cut(self.advantages, rows, T),
                               old_logprobs=_cut(self.old_logprobs, rows, T),
                               ref_logprobs=_cut(self.ref_logprobs, rows, T),
                               old_values=_cut(self.old_values, rows, T), returns=_cut(self.returns, rows, T),
                               metrics=dict(self.metrics)))
        return out


class RolloutTrainer:
    """Rollouts -> device batch, temperature, old / reference log-probs. Subclassed by GRPO and PPO."""

    name = "trainer"

    def __init__(self, model, tokenizer, config, ref_model=None):
        if ref_model is not None and ref_model is model:
            raise ValueError(f"{self.name}: ref_model is the policy itself, so the KL to it is always 0. Pass a frozen "
                             "copy (copy.deepcopy(model).eval()) or, for a peft model, no ref_model (the adapter is "
                             "disabled for the reference)")
        check_vocabulary(model, tokenizer)
        self.model, self.tokenizer, self.config, self.ref_model = model, tokenizer, config, ref_model
        if config.beta > 0 and ref_model is None and not is_peft_model(model):
            raise ValueError(f"{self.name}: beta={config.beta} > 0 needs a reference: pass ref_model= "
                             "(e.g. copy.deepcopy(model).eval()) or use a peft model (its adapter is disabled)")
        self.metrics: dict[str, float] = {}
        self._dropout_checked = False
        self.policy_version: int | None = None  # the trainer's current version: staleness metrics when set
        self.token_logprobs: torch.Tensor | None = None  # (B, T) of the last loss call, NaN where not trained

    def calculate_loss(self, rollouts, rewards=None, normalizer: float | None = None) -> torch.Tensor:
        """Scalar loss over `rollouts` (or a prepared `TrainBatch`); diagnostics land in `.metrics`.

        normalizer: the aggregator's denominator of the FULL batch when you pass
        micro-batches yourself (see the subclass's `loss`).
        """
        if isinstance(rollouts, TrainBatch):
            if rewards is not None:
                raise ValueError("calculate_loss(prepared_batch) takes no rewards: they are in the prepared batch")
            tb = rollouts
        else:
            if rewards is None:
                raise ValueError("calculate_loss(rollouts, rewards) needs one reward per rollout")
            tb = self.prepare(rollouts, rewards, compute_old=False)
        return self.loss(tb, normalizer)

    def check_dropout(self) -> None:
        """Warn once per model when it trains with dropout on (ratios are then not exactly 1 on-policy)."""
        if not self.model.training or self._dropout_checked:
            return
        self._dropout_checked = True
        active = active_dropout(self.model)
        if active:
            warn_user(f"{self.name}: the model trains with dropout on ({len(active)} modules, e.g. {active[0]}): "
                      "log-probs then come from a random sub-network, on-policy ratios are not 1 and clipping "
                      "bites where it should not. Call SimpleTorchLLMRL.model.dropout.disable_dropout(model) first.")

    def encode(self, rollouts: list[Rollout]) -> Batch:
        if not rollouts:
            raise ValueError(f"{self.name}: no rollouts given")
        batch = rollouts_to_batch(list(rollouts), self.tokenizer, self.config.max_length, self.config.truncate)
        return batch.to(model_device(self.model))

    def resolve_temperature(self, batch: Batch) -> float:
        """The sampling temperature recorded with the log-probs wins (none recorded: the configured one, else 1).

        temperature=None (the default) takes the recorded one silently; a configured one that
        differs from the recorded one is reported, and the recorded one is used.
        """
        t, s = self.config.temperature, batch.sampling_temperature
        if s is None:
            return 1.0 if t is None else t
        if t is not None and abs(s - t) > 1e-6:
            warn_user(
                f"{self.name}: the rollouts were sampled at temperature={s} but the trainer is configured with "
                f"temperature={t}. Log-probs are recomputed at the sampling temperature {s} so the importance "
                f"ratio compares like with like; pass temperature={s} (or None: follow the rollouts) to silence this.")
        return float(s)

    def logprobs(self, model, batch: Batch, mask: torch.Tensor, temperature: float, entropy: bool = False):
        return token_logprobs(model, batch, temperature, self.config.chunk_size, return_entropy=entropy,
                              positions=mask, share_prefix=getattr(self.config, "share_prefix", False))

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch, mask: torch.Tensor, temperature: float) -> torch.Tensor | None:
        """(B, T) under the reference: `ref_model`, else the peft model with its adapter off; None if beta == 0."""
        if self.config.beta == 0:
            return None
        if self.ref_model is not None:
            return self.logprobs(self.ref_model, batch, mask, temperature)
        with use_adapter(self.model, None):  # every adapter off; which ones train is left as it was
            return self.logprobs(self.model, batch, mask, temperature)
