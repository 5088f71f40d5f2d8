"""The one preparation pipeline of every front, and a loss unit run on its result; plain functions.

Legend: B rollouts, T tokens, N trained tokens. Per-token tensors are (B, T), aligned with input_ids.

    train_batch: check_rewards -> encode (token ids checked) -> trained_mask -> trained_index -> prefix plan
                 -> resolve_temperature -> pack plan; then the no-grad passes (`logprobs_pass`, `reference_logprobs`)
    run_unit:    `scoring.score` -> `loss_inputs` (the N trained tokens) -> unit(inputs, config) -> LossOutput

Everything data-dependent (which tokens are trained, which rows share a prompt, the checks) is found
before any forward; the loss and its backward never wait for the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from SimpleTorchLLMRL.chat.message import Rollout, sampled_versions
from SimpleTorchLLMRL.chat.tokenize import Batch, rollouts_to_batch
from SimpleTorchLLMRL.model.adapters import use_adapter
from SimpleTorchLLMRL.model.lora import is_peft_model
from SimpleTorchLLMRL.model.scoring.head import check_token_ids, check_vocabulary
from SimpleTorchLLMRL.model.scoring.logprobs import ComputeOptions, Scores, packs, scatter_index, score
from SimpleTorchLLMRL.model.scoring.packing import PackPlan, plan_packing
from SimpleTorchLLMRL.model.scoring.shared_prefix import PrefixPlan, first_positions, plan_shared_prefix
from SimpleTorchLLMRL.trainer.losses import LazyMetrics, LossInputs, LossOutput
from SimpleTorchLLMRL.utils.warn import warn_user

# ---------------------------------------------------------------- checks


def check_rewards(rewards, num_rollouts: int) -> torch.Tensor:
    """Rewards as a (B,) float32 CPU tensor; ValueError naming the rollouts with a None, NaN or inf, or the shape."""
    if not isinstance(rewards, torch.Tensor):
        rewards = list(rewards)
        missing = [i for i, r in enumerate(rewards) if r is None]
        if missing:
            raise ValueError(f"rewards of rollouts {missing[:10]} are None; every rollout needs a number")
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


def staleness_metrics(rollouts: list[Rollout], current: int | None) -> dict[str, float]:
    """Versions behind the current policy of the sampled turns: mean and max (empty without versions)."""
    versions = sampled_versions(rollouts)
    if current is None or not versions:
        return {}
    behind = [current - v for v in versions]
    return {"staleness_mean": sum(behind) / len(behind), "staleness_max": float(max(behind))}


# ---------------------------------------------------------------- encode, masks, index, temperature


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def encode(name: str, rollouts: list[Rollout], tokenizer, model, compute: ComputeOptions) -> Batch:
    """Rollouts -> a right-padded `Batch` on the model's device (as-sampled ids, masks, sampler log-probs)."""
    if not rollouts:
        raise ValueError(f"{name}: no rollouts given")
    batch = rollouts_to_batch(list(rollouts), tokenizer, compute.max_length, compute.truncate)
    check_token_ids(name, batch, model)
    return batch.to(model_device(model))


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

    Position t predicts token t + 1, so the trained tokens are at index + 1, in row-major order.
    Finding them waits for the device once (a `nonzero`), before any forward."""
    select = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)  # (B, T)
    select[:, :-1] = mask[:, 1:].bool()
    return select.reshape(-1).nonzero().squeeze(1)


def resolve_temperature(name: str, configured: float | None, recorded: float | None) -> float:
    """The temperature recorded with the rollouts (a warning if a configured one differs), else the configured, else 1."""
    if recorded is None:
        return 1.0 if configured is None else configured
    if configured is not None and abs(recorded - configured) > 1e-6:
        warn_user(
            f"{name}: the rollouts were sampled at temperature={recorded} but the trainer is configured with "
            f"temperature={configured}. Log-probs are recomputed at the sampling temperature {recorded} so the "
            f"importance ratio compares like with like; pass temperature={recorded} (or None: follow the "
            "rollouts) to silence this.")
    return float(recorded)


# ---------------------------------------------------------------- groups


def groups_from_size(batch_size: int, group_size: int) -> torch.Tensor:
    """Consecutive blocks of `group_size`: (B,) long."""
    if group_size < 1 or batch_size % group_size:
        raise ValueError(f"group_size={group_size} does not divide the batch of {batch_size} rollouts")
    return torch.arange(batch_size) // group_size


def groups_from_keys(keys: list) -> torch.Tensor:
    """Equal (hashable) keys form a group, numbered by first appearance: (B,) long."""
    index: dict = {}
    return torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.long)


def group_sizes(group: torch.Tensor) -> torch.Tensor:
    """How many rollouts share each rollout's group, (B,)."""
    return torch.bincount(group)[group]


def rollout_groups(rollouts: list[Rollout], group_size: int | None = None) -> torch.Tensor:
    """(B,) long group index: `group_size` blocks, else metadata["group_id"] (on every rollout), else the prompt."""
    if group_size is not None:
        return groups_from_size(len(rollouts), group_size)
    ids = [r.metadata.get("group_id") for r in rollouts]
    if all(i is not None for i in ids):
        return groups_from_keys(ids)
    if any(i is not None for i in ids):
        missing = [k for k, i in enumerate(ids) if i is None]
        raise ValueError(f"metadata['group_id'] is set on some rollouts but not on rollouts {missing[:10]}")
    return groups_from_keys([tuple((m.role, m.name, m.content) for m in r.prompt_messages) for r in rollouts])


# ---------------------------------------------------------------- the batch a loss reads


@dataclass
class TrainBatch:
    """Everything a loss needs for one (micro-)batch, on the model's device; `split` cuts micro-batches.

    advantages: (B,) per rollout, (B, T) per token (PPO), or None. old_logprobs (the trainer's before
    the update; None: on-policy), ref_logprobs, teacher_logprobs, old_values, returns: (B, T) or None.
    normalizer: the FULL batch's denominator of the loss' aggregate. token_index: (N,) `trained_index(mask)`;
    prefix_plan: which rows share their prompt (`share_prefix`); pack_plan: where each row sits when the batch
    runs packed (`packed`); all found before any forward.
    metrics: the batch-level numbers of `prepare` (rewards, advantages, staleness).
    """

    batch: Batch
    mask: torch.Tensor
    rewards: torch.Tensor
    temperature: float
    normalizer: float
    token_index: torch.Tensor
    prefix_plan: PrefixPlan | None = None
    pack_plan: PackPlan | None = None
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    group: torch.Tensor | None = None
    metrics: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.batch)

    input_ids = property(lambda self: self.batch.input_ids)  # (B, T): what `scoring.score` reads
    attention_mask = property(lambda self: self.batch.attention_mask)
    truncation = property(lambda self: self.batch.truncation)
    sampler_logprobs = property(lambda self: self.batch.sampler_logprobs)  # (B, T), NaN where unknown

    def split(self, micro_batch_size: int) -> list[TrainBatch]:
        """Row slices of at most `micro_batch_size`, trimmed of all-padding columns; each keeps the normalizer."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        out = []
        for s in range(0, len(self), micro_batch_size):
            rows = slice(s, s + micro_batch_size)
            T = int(self.batch.attention_mask[rows].sum(-1).max())
            cut = {f.name: _cut(getattr(self, f.name), rows, T) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
            part = replace(self, batch=self.batch[rows].columns(T), metrics=dict(self.metrics), **cut)
            part.token_index = trained_index(part.mask)
            part.prefix_plan = None if self.prefix_plan is None else prefix_plan(part.batch, part.mask)
            plan = self.pack_plan
            part.pack_plan = None if plan is None else plan_packing(part.mask, part.token_index, plan.length_buckets)
            out.append(part)
        return out


def _cut(t: torch.Tensor, rows: slice, T: int) -> torch.Tensor:
    """Rows of a (B,) or (B, T) tensor, the latter cut to its first T columns."""
    return t[rows, :T] if t.dim() == 2 else t[rows]


def prefix_plan(batch: Batch, mask: torch.Tensor) -> PrefixPlan:
    """Which rows share their tokens before the first trained one (`share_prefix`); waits for the device."""
    return plan_shared_prefix(batch.input_ids, batch.attention_mask, first_positions(mask))


def pack_plan(model, mask: torch.Tensor, token_index: torch.Tensor, compute: ComputeOptions) -> PackPlan | None:
    """Where each row sits when the batch runs packed (`compute.packed`, `model`'s attention), else None;
    waits for the device. packed=True on a model whose attention cannot take packed rows: ValueError."""
    if not packs(model, compute):
        return None
    return plan_packing(mask, token_index, compute.length_buckets)


def train_batch(name: str, model, tokenizer, rollouts: list[Rollout], compute: ComputeOptions, *,
                temperature: float | None = None, rewards=None, normalizer: Callable[[torch.Tensor], float],
                metrics: dict | None = None, follow_sampling: bool = True) -> TrainBatch:
    """rollouts -> (rewards checked) encode -> mask -> index -> prefix plan -> temperature: a `TrainBatch`.
    normalizer(mask): the full batch's denominator. follow_sampling False (SFT, DPO: the data's likelihood):
    the full softmax at the configured temperature (1.0), not the one or the truncation the rollouts record."""
    r = None if rewards is None else check_rewards(rewards, len(rollouts))
    batch = encode(name, rollouts, tokenizer, model, compute)
    mask = trained_mask(batch)
    plan = prefix_plan(batch, mask) if compute.share_prefix else None
    t = resolve_temperature(name, temperature, batch.sampling_temperature) if follow_sampling else temperature or 1.0
    batch.truncation = batch.truncation if follow_sampling else None
    r = torch.zeros(len(rollouts)) if r is None else r
    index = trained_index(mask)
    return TrainBatch(batch, mask, r.to(mask.device), t, normalizer(mask), index, plan,
                      pack_plan(model, mask, index, compute), metrics={**(metrics or {}), "temperature": t})


def as_train_batch(rollouts, rewards, prepare: Callable[..., TrainBatch]) -> TrainBatch:
    """`calculate_loss`'s input: a prepared `TrainBatch` as it is, or rollouts + rewards prepared on-policy."""
    if isinstance(rollouts, TrainBatch):
        if rewards is not None:
            raise ValueError("calculate_loss(prepared_batch) takes no rewards: they are in the prepared batch")
        return rollouts
    if rewards is None:
        raise ValueError("calculate_loss(rollouts, rewards) needs one reward per rollout")
    return prepare(rollouts, rewards, compute_old=False)


# ---------------------------------------------------------------- the no-grad passes


@torch.no_grad()
def logprobs_pass(model, tb: TrainBatch, compute: ComputeOptions) -> torch.Tensor:
    """(B, T) float32 log-probs of the trained tokens under `model` (0 elsewhere), without grad."""
    s = score(model, tb, compute, temperature=tb.temperature)
    return scatter_index(s.logprobs.float(), tb.token_index + 1, tuple(tb.mask.shape))


@torch.no_grad()
def reference_logprobs(model, ref_model, tb: TrainBatch, compute: ComputeOptions) -> torch.Tensor:
    """(B, T) under the reference: `ref_model`, else `model` with every adapter off (which ones train is kept)."""
    if ref_model is not None:
        return logprobs_pass(ref_model, tb, compute)
    with use_adapter(model, None):
        return logprobs_pass(model, tb, compute)


# ---------------------------------------------------------------- the loss unit on the batch


def loss_inputs(tb: TrainBatch, normalizer: float | None = None, *, logprobs=None, entropy=None, extra=None,
                **per_token) -> LossInputs:
    """The N trained tokens' `LossInputs`: tb's (B, T) fields (and `per_token`'s, which override them) picked
    at the trained tokens, (B,) ones repeated on each row's tokens; no host sync."""
    B, T = tb.mask.shape
    at = tb.token_index + 1  # (N,) flat positions of the trained tokens
    row = torch.div(at, T, rounding_mode="floor")  # (N,)

    def pick(t):
        return None if t is None else t.index_select(0, row) if t.dim() == 1 else t.reshape(-1).index_select(0, at)

    names = ("advantages", "old_logprobs", "sampler_logprobs", "ref_logprobs", "teacher_logprobs", "old_values",
             "returns")
    picked = {n: pick(per_token.pop(n, getattr(tb, n))) for n in names}
    picked.update({n: pick(t) for n, t in per_token.items()})
    return LossInputs(logprobs=logprobs, row=row, rows=B, row_tokens=tb.mask.sum(-1).float().index_select(0, row),
                      normalizer=tb.normalizer if normalizer is None else normalizer, entropy=entropy, group=tb.group,
                      temperature=tb.temperature, extra=extra or {}, **picked)


def run_unit(unit, config, model, tb: TrainBatch, compute: ComputeOptions, normalizer: float | None = None, *,
             hidden: torch.Tensor | None = None, scores: Scores | None = None, **per_token) -> LossOutput:
    """`unit(loss_inputs(...), config)` on the policy's log-probs of `tb`, as a front's `LossOutput`.

    A config whose `token_level` is true (the loss a sum of per-token terms) lets the head form the
    gradient chunk by chunk in the forward (`ComputeOptions.fused`); the unit then runs once more on
    the detached log-probs for its metrics and for the gradient of what else it trains (a critic).
    scores: the caller's `scoring.score` of tb (then nothing is scored here); per_token: as `loss_inputs`."""
    base = loss_inputs(tb, normalizer, **per_token)
    if scores is None:
        token_loss = None
        if getattr(config, "token_level", False):
            frozen = replace(base, **{f.name: getattr(base, f.name).detach() for f in fields(base)
                                      if isinstance(getattr(base, f.name), torch.Tensor)})
            token_loss = lambda lp, sl: unit(frozen.chunk(sl, lp), config).loss  # noqa: E731
        scores = score(model, tb, compute, temperature=tb.temperature, hidden=hidden, token_loss=token_loss)
    out = unit(replace(base, logprobs=scores.logprobs, entropy=scores.entropy), config)
    loss = out.loss if scores.loss is None else scores.loss + (out.loss - out.loss.detach())
    metrics = LazyMetrics.merged(tb.metrics, out.metrics, temperature=tb.temperature)  # tensors until read
    metrics["loss"] = loss.detach()
    full = scatter_index(scores.logprobs.detach().float(), tb.token_index + 1, tuple(tb.mask.shape), torch.nan)
    return LossOutput(loss, metrics, full)  # token_logprobs (B, T), NaN where not trained
