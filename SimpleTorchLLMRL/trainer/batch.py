"""Rollouts -> a token batch on the model's device, and the checks and log-prob passes around it.

Legend: B rollouts, T tokens. Per-token tensors are (B, T), aligned with input_ids.

Plain functions, shared by the GRPO and PPO fronts (no base class). Log-prob
fields are named by where they come from:

    sampler_logprobs  the generator's, recorded with each sampled token (`Batch.sampler_logprobs`)
    old_logprobs      recomputed by the trainer before the update (None: on-policy, the current ones)
    ref_logprobs      the reference policy's (None when beta == 0)

`TrainBatch` carries them with the advantages and splits into micro-batches
that keep the full batch's normalizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from SimpleTorchLLMRL.chat.message import Rollout, sampled_versions
from SimpleTorchLLMRL.chat.tokenize import Batch, rollouts_to_batch
from SimpleTorchLLMRL.model.adapters import use_adapter
from SimpleTorchLLMRL.model.dropout import active_dropout
from SimpleTorchLLMRL.model.lora import is_peft_model
from SimpleTorchLLMRL.model.scoring.head import check_vocabulary
from SimpleTorchLLMRL.model.scoring.shared_prefix import PrefixPlan, first_positions, plan_shared_prefix
from SimpleTorchLLMRL.trainer.losses import LossOutput, old_and_tis  # noqa: F401  (old_and_tis: its old import path)
from SimpleTorchLLMRL.trainer.options import ComputeOptions, split_options  # noqa: F401  (their old import path)
from SimpleTorchLLMRL.utils.warn import warn_user

# ---------------------------------------------------------------- checks


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


def check_policy(name: str, model, tokenizer, ref_model, beta: float) -> None:
    """The policy / reference / tokenizer combination a trainer is built with; ValueError naming the fix."""
    if ref_model is not None and ref_model is model:
        raise ValueError(f"{name}: ref_model is the policy itself, so the KL to it is always 0. Pass a frozen "
                         "copy (copy.deepcopy(model).eval()) or, for a peft model, no ref_model (the adapter is "
                         "disabled for the reference)")
    check_vocabulary(model, tokenizer)
    if beta > 0 and ref_model is None and not is_peft_model(model):
        raise ValueError(f"{name}: beta={beta} > 0 needs a reference: pass ref_model= "
                         "(e.g. copy.deepcopy(model).eval()) or use a peft model (its adapter is disabled)")


def warn_if_dropout(name: str, model) -> bool:
    """Warn when a training model has dropout on (ratios are then not exactly 1 on-policy).

    Returns whether the model was checked (it is in training mode): callers check once."""
    if not model.training:
        return False
    active = active_dropout(model)
    if active:
        warn_user(f"{name}: the model trains with dropout on ({len(active)} modules, e.g. {active[0]}): "
                  "log-probs then come from a random sub-network, on-policy ratios are not 1 and clipping "
                  "bites where it should not. Call SimpleTorchLLMRL.model.dropout.disable_dropout(model) first.")
    return True


def trained_mask(batch: Batch) -> torch.Tensor:
    """loss_mask without column 0 (nothing predicts the first token), (B, T); every row must train something."""
    mask = batch.loss_mask.clone()
    mask[:, 0] = 0
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rollouts {empty[:10]} have no trainable token (no trainable MODEL message after "
                         "the first token); drop them or mark a message trainable=True")
    return mask


def trained_index(mask: torch.Tensor) -> torch.Tensor:
    """(N,) long: the flat positions b * T + t of a (B, T) batch whose hidden state predicts a trained token.

    Position t predicts token t + 1, so these are the t with mask[b, t + 1] set, in row-major
    order (the order of `x[:, :-1][mask[:, 1:].bool()]`); the trained tokens are at index + 1.
    Finding them waits for the device once (a `nonzero`): `prepare` and `split` do it before any
    forward, so the loss reads its tokens with `index_select` and never syncs.
    """
    select = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)  # (B, T)
    select[:, :-1] = mask[:, 1:].bool()
    return select.reshape(-1).nonzero().squeeze(1)


def staleness_metrics(rollouts: list[Rollout], current: int | None) -> dict[str, float]:
    """Versions behind the current policy of the sampled turns: mean and max (empty without versions)."""
    versions = sampled_versions(rollouts)
    if current is None or not versions:
        return {}
    behind = [current - v for v in versions]
    return {"staleness_mean": sum(behind) / len(behind), "staleness_max": float(max(behind))}


def model_device(model) -> torch.device:
    return next(model.parameters()).device


# ---------------------------------------------------------------- encode


def encode(name: str, rollouts: list[Rollout], tokenizer, device, max_length: int | None = None,
           truncate: bool = False) -> Batch:
    """Rollouts -> a right-padded `Batch` on `device` (as-sampled ids, masks, sampler log-probs)."""
    if not rollouts:
        raise ValueError(f"{name}: no rollouts given")
    return rollouts_to_batch(list(rollouts), tokenizer, max_length, truncate).to(device)


def resolve_temperature(name: str, configured: float | None, recorded: float | None) -> float:
    """The sampling temperature recorded with the log-probs wins (none recorded: the configured one, else 1).

    configured=None (the default) takes the recorded one silently; a configured one that
    differs from the recorded one is reported, and the recorded one is used.
    """
    if recorded is None:
        return 1.0 if configured is None else configured
    if configured is not None and abs(recorded - configured) > 1e-6:
        warn_user(
            f"{name}: the rollouts were sampled at temperature={recorded} but the trainer is configured with "
            f"temperature={configured}. Log-probs are recomputed at the sampling temperature {recorded} so the "
            f"importance ratio compares like with like; pass temperature={recorded} (or None: follow the "
            "rollouts) to silence this.")
    return float(recorded)


@torch.no_grad()
def reference_logprobs(model, ref_model, logprobs: Callable) -> torch.Tensor:
    """(B, T) under the reference: `ref_model`, else `model` with every adapter off (which ones train is kept).

    logprobs(model) -> (B, T): the caller's log-prob pass over its batch.
    """
    if ref_model is not None:
        return logprobs(ref_model)
    with use_adapter(model, None):
        return logprobs(model)


# ---------------------------------------------------------------- the batch a loss reads


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
    the current policy, detached, i.e. on-policy). The generator's log-probs are
    `sampler_logprobs` (from `batch`). normalizer: the FULL batch's denominator.
    metrics: the batch-level numbers of `prepare` (rewards, advantages, staleness).
    token_index: (N,) long `trained_index(mask)`, found once before any forward (`prepare`, `split`);
    None: the loss finds it (one host sync). prefix_plan: with `share_prefix`, which rows share their
    prompt (`model.scoring.shared_prefix.plan_shared_prefix`), found before any forward likewise.
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
    token_index: torch.Tensor | None = None
    prefix_plan: PrefixPlan | None = None

    def __len__(self) -> int:
        return len(self.batch)

    @property
    def sampler_logprobs(self) -> torch.Tensor | None:
        """(B, T) the generator's log-probs, NaN where unknown; None when no rollout carries any."""
        return self.batch.sampler_logprobs

    def split(self, micro_batch_size: int) -> list[TrainBatch]:
        """Row slices of at most `micro_batch_size`, trimmed of all-padding columns."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        out = []
        for s in range(0, len(self), micro_batch_size):
            rows = slice(s, s + micro_batch_size)
            T = int(self.batch.attention_mask[rows].sum(-1).max())
            b = self.batch[rows].columns(T)
            mask = _cut(self.mask, rows, T)
            plan = None if self.prefix_plan is None else plan_shared_prefix(b.input_ids, b.attention_mask,
                                                                            first_positions(mask))
            out.append(replace(self, batch=b, mask=mask, rewards=self.rewards[rows], token_index=trained_index(mask),
                               prefix_plan=plan,
                               advantages=_cut(self.advantages, rows, T),
                               old_logprobs=_cut(self.old_logprobs, rows, T),
                               ref_logprobs=_cut(self.ref_logprobs, rows, T),
                               old_values=_cut(self.old_values, rows, T), returns=_cut(self.returns, rows, T),
                               metrics=dict(self.metrics)))
        return out


StepOutput = LossOutput  # the fronts' `compute` returns the loss units' type; token_logprobs (B, T), NaN off the mask


def as_train_batch(rollouts, rewards, prepare: Callable[..., TrainBatch]) -> TrainBatch:
    """`calculate_loss`'s input: a prepared `TrainBatch` as it is, or rollouts + rewards prepared on-policy."""
    if isinstance(rollouts, TrainBatch):
        if rewards is not None:
            raise ValueError("calculate_loss(prepared_batch) takes no rewards: they are in the prepared batch")
        return rollouts
    if rewards is None:
        raise ValueError("calculate_loss(rollouts, rewards) needs one reward per rollout")
    return prepare(rollouts, rewards, compute_old=False)
