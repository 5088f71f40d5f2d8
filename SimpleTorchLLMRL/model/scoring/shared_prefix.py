"""Forward a group's shared prompt once: the rows of a GRPO group start with the same tokens.

Legend: B rows, U distinct prefixes, P prefix tokens, S suffix tokens, T tokens, H hidden size.

G completions of one prompt repeat the prompt G times in a (B, T) batch. A row only
needs hidden states from `start` on (the position that predicts its first trained
token); the tokens before `start` matter through their keys and values alone. So the
U distinct prefixes run once, with a KV cache, and every row runs only its suffix,
attending to its prefix's cached keys and values:

    prefix forward   (U, P) left-padded, positions 0..P-1, use_cache    -> K, V per layer
    select           K, V (U, ...) -> (B, ...) by each row's prefix (autograd sums the G copies' gradients)
    suffix forward   (B, S) right-padded, positions start..start+S-1, attention mask [prefix | suffix]

The causal mask runs over cache slots (every prefix slot comes before every suffix
slot), padding is masked by the 2D attention mask, and RoPE / learned positions come
from the explicit position ids, so each row's hidden states and gradients equal those
of the plain forward over its whole sequence (up to float summation order). The
prefix's MLPs, projections and saved activations are paid U times instead of B.

Used by the fronts' `share_prefix=True` (`scoring.logprobs.score`) for their loss and no-grad
log-prob passes, and in spirit by the HF generator, which prefills each distinct prompt once
(`hf_backend`). `shared_hidden_states` is the forward with this option: the plain one
(`head.final_hidden_states`) where nothing is shared.

Which rows share which prefix is data (`plan_shared_prefix`, a `PrefixPlan`): finding it waits
for the device, so the trainer finds it before the forward (`prepare`, `split`) and the
forward itself never syncs (the prefix forward gets a 4D mask, which HF uses as given).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from SimpleTorchLLMRL.model.scoring.head import (
    causal_mask_4d,
    check_same_states,
    final_hidden_states,
    forward_last_logits,
    in_eval_without_grad,
    last_hidden,
    maybe_verify_head,
    scoring_forward,
)

_VERIFIED: weakref.WeakSet = weakref.WeakSet()  # models whose shared forward was checked against the plain one


def first_positions(positions: torch.Tensor) -> torch.Tensor:
    """(B,) long: the first position whose hidden state each row needs.

    positions (B, T) 0/1 marks the tokens to score; token t is predicted from position
    t - 1, so the first needed hidden state is one before the first marked token (0 for
    a row that marks nothing or marks column 0).
    """
    marked = positions.bool()
    first = torch.where(marked.any(-1), marked.int().argmax(-1), 0)  # (B,)
    return (first - 1).clamp(min=0)


def prefix_groups(input_ids: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, list[int]] | None:
    """Rows whose tokens before `start` are identical share one prefix.

    input_ids (B, T), start (B,) -> (row_to_prefix (B,) long, one representative row per
    prefix (U,)), or None when sharing saves nothing (every prefix distinct, or a row
    with an empty prefix).
    """
    starts = start.tolist()
    if min(starts) == 0:
        return None
    rows = input_ids.tolist()
    index: dict[tuple[int, ...], int] = {}
    owner: list[int] = []
    group: list[int] = []
    for i, (row, s) in enumerate(zip(rows, starts, strict=True)):
        u = index.setdefault(tuple(row[:s]), len(owner))
        if u == len(owner):
            owner.append(i)
        group.append(u)
    if len(owner) == len(rows):
        return None
    return torch.tensor(group, device=input_ids.device), owner


class PrefixPlan(NamedTuple):
    """The rows' shared prefixes, found on host-readable data before the forward (`plan_shared_prefix`)."""

    start: torch.Tensor  # (B,) long, the first position whose hidden state each row needs
    group: torch.Tensor | None  # (B,) long, each row's prefix; None: nothing is shared, run the plain forward
    owner: torch.Tensor | None  # (U,) long, one row per prefix
    prefix_len: int  # P: the longest prefix
    suffix_len: int  # S: the longest suffix


def plan_shared_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor, start: torch.Tensor) -> PrefixPlan:
    """Which rows of a right-padded (B, T) batch share their tokens before `start` (B,); waits for the device.

    The plan's group is None (the plain forward runs) when the batch is left-padded or no two
    rows share a prefix.
    """
    left_padded = bool((attention_mask[:, :-1] < attention_mask[:, 1:]).any())  # a 0 before a 1
    groups = None if left_padded else prefix_groups(input_ids, start)
    if groups is None:
        return PrefixPlan(start, None, None, 0, 0)
    group, owner = groups
    own = torch.tensor(owner, device=input_ids.device)
    lengths = attention_mask.sum(-1)  # (B,) right-padded: real tokens first
    return PrefixPlan(start, group, own, int(start[own].max()), int((lengths - start).max()))


@scoring_forward()  # the trainer's forwards (`head.in_scoring_forward`)
def shared_prefix_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                start: torch.Tensor, plan: PrefixPlan | None = None):
    """(B, T, H) final hidden states of a right-padded batch, exact from `start` on, 0 before it.

    Returns (hidden, output of the suffix forward), or None (the caller runs the plain
    forward) when no two rows share a prefix, the batch is not right-padded, or the model
    gives no cache (gradient checkpointing turns HF's cache off). plan: `plan_shared_prefix`'s
    for this batch (found before the forward: then nothing here waits for the device).
    """
    plan = plan if plan is not None else plan_shared_prefix(input_ids, attention_mask, start)
    if plan.group is None or getattr(model, "is_gradient_checkpointing", False):
        return None
    group, own, P, S = plan.group, plan.owner, plan.prefix_len, plan.suffix_len
    device = input_ids.device
    lengths = attention_mask.sum(-1)  # (B,) right-padded: real tokens first
    # left-padded (U, P): every prefix ends at slot P - 1, so cache slots and positions differ by one
    # constant per row in prefix and suffix alike (what sliding-window layers and their caches assume)
    pos = torch.arange(P, device=device)[None] - (P - start[own, None])  # (U, P) position of each slot
    prefix_mask = (pos >= 0).long()  # (U, P)
    prefix_ids = torch.where(pos >= 0, input_ids[own].gather(1, pos.clamp(min=0)), 0)
    attention = causal_mask_4d(model, prefix_mask)  # HF reads a 2D mask for padding (a host sync); a 4D one it uses
    out = forward_last_logits(model, input_ids=prefix_ids, attention_mask=prefix_mask if attention is None else attention,
                              position_ids=pos.clamp(min=0), use_cache=True)
    cache = getattr(out, "past_key_values", None)
    if cache is None:
        return None
    cache.batch_select_indices(group)  # (U, ...) -> (B, ...)

    cols = start[:, None] + torch.arange(S, device=device)[None]  # (B, S) positions of the suffix tokens
    in_row = cols < lengths[:, None]  # (B, S)
    suffix_ids = torch.where(in_row, input_ids.gather(1, cols.clamp(max=input_ids.shape[1] - 1)), 0)
    mask = torch.cat([prefix_mask[group], in_row.long()], dim=1)  # (B, P + S): [prefix | suffix]
    position_ids = torch.where(in_row, cols, start[:, None])  # padding stays inside the row's positions
    out = forward_last_logits(model, input_ids=suffix_ids, attention_mask=mask, position_ids=position_ids,
                              past_key_values=cache, use_cache=True, output_hidden_states=True)
    hs = last_hidden(out)  # (B, S, H)
    T = input_ids.shape[1]
    at = torch.arange(T, device=device)[None] - start[:, None]  # (B, T) suffix index of each position
    valid = (at >= 0) & (at < S)
    picked = hs.gather(1, at.clamp(0, S - 1)[..., None].expand(-1, -1, hs.shape[-1]))  # (B, T, H)
    return torch.where(valid[..., None], picked, torch.zeros((), dtype=hs.dtype, device=device)), out


def check_shared_prefix(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: torch.Tensor) -> None:
    """Once per model: the shared forward's hidden states from `start` on equal the plain forward's.

    Both run without grad in eval mode (dropout would make them differ); raises ValueError
    naming the model when they do not agree, e.g. a model whose attention or positions do
    not follow the cache the way HF's decoders do.
    """
    if model in _VERIFIED:
        return

    def both():
        shared = shared_prefix_hidden_states(model, input_ids, attention_mask, start)
        return None if shared is None else (shared[0], final_hidden_states(model, input_ids, attention_mask, False))

    pair = in_eval_without_grad(model, both)
    if pair is None:
        return
    cols = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    needed = (cols >= start[:, None]) & attention_mask.bool()  # (B, T)
    check_same_states(model, pair[0][needed], pair[1][needed], "share_prefix gives other hidden states than the "
                      "plain forward (max abs difference {err}); this model does not run a suffix against a cached "
                      "prefix the way share_prefix needs (its attention, cache or position handling differs). Use "
                      "share_prefix=False.")
    _VERIFIED.add(model)


def shared_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         start: torch.Tensor | None = None, verify: bool = True, *, plan: PrefixPlan | None = None,
                         right_padded: bool = False) -> torch.Tensor:
    """(B, T, H) final hidden states, rows that share their tokens before `start` (B,) running them once.

    Only positions >= start are needed (they are exact; positions before are 0). Checked once
    per model against the plain forward. plan: `plan_shared_prefix(input_ids, attention_mask,
    start)` found before the forward (else found here, which waits for the device). Without a
    shared prefix (or a cache): the plain forward, `head.final_hidden_states`.
    """
    if plan is None and start is not None and attention_mask is not None:
        plan = plan_shared_prefix(input_ids, attention_mask, start)
    if plan is not None and plan.group is not None:
        if verify:
            check_shared_prefix(model, input_ids, attention_mask, plan.start)
        shared = shared_prefix_hidden_states(model, input_ids, attention_mask, plan.start, plan=plan)
        if shared is not None:
            hidden, out = shared
            maybe_verify_head(model, out, verify)  # against the suffix forward's own last position
            return hidden
    return final_hidden_states(model, input_ids, attention_mask, verify, right_padded=right_padded)
