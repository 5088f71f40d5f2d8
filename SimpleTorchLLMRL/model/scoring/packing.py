"""Padding-free batches: the rows of a batch packed side by side, attention kept inside each row.

Legend: B rows, T tokens (padded), R packed rows, C slots per packed row, N scored tokens, H hidden size.

A right-padded (B, T) batch of ragged rows spends its body, head and loss on padding. Packed, each
row's tokens (up to its last scored one) sit in an (R, C) layout with its own position ids 0..n-1
and an attention that never crosses rows, so the forward runs on real tokens only (plus the slots
that round a packed row up):

    "mask" (sdpa, eager)   first-fit-decreasing into R rows of C = the longest row (rounded up by
                           `length_buckets`) slots, a (R, 1, C, C) block-causal mask: the attention
                           costs R C^2, no more than the padded batch's B T^2
    "varlen" (flash)       one row, R = 1, C = all rows' tokens: flash-attention's varlen kernel
                           reads the rows' boundaries (`cu_seq_lens_q` / `_k`, `max_length_q` / `_k`)

Where each row sits is data (`plan_packing`, a `PackPlan`): finding it waits for the device, so the
trainer finds it before the forward (`prepare`, `split`) and the forward itself never syncs (the
mask is built on the device from the plan; HF uses a 4D mask as given, and flash's boundaries come
precomputed). `packed_hidden_states` is the forward; `packing_kind` says whether a model's attention
takes packed rows; `check_packing` holds a model's packed forward to its padded one once.

`length_buckets` (k): lengths rounded up to one of k sizes per doubling (`bucket`), so a compiled
body sees a bounded set of shapes over a stream of ragged batches (`torch.compile` of the decoder
layers compiles once per shape).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from SimpleTorchLLMRL.model.scoring.head import (
    forward_last_logits,
    last_hidden,
    mask_for_attention,
    maybe_verify_head,
    sliding_window_layers,
    unwrap,
)

_VERIFIED: weakref.WeakSet = weakref.WeakSet()  # models whose packed forward was checked against the padded one
KINDS = ("mask", "varlen")


def bucket(n: int, steps: int | None) -> int:
    """n rounded up to one of `steps` sizes per doubling (None: n itself); at most 1 / steps of it is added."""
    if steps is None or n <= steps:
        return n
    step = (1 << (n.bit_length() - 1)) // steps  # n >= 2^k: sizes 2^k + j 2^k / steps
    return -(-n // step) * step


def packing_kind(model) -> str | None:
    """How `model`'s attention takes packed rows: "mask" (sdpa / eager, full attention), "varlen" (flash
    attention), or None (flex or another attention, or sliding-window layers under a mask)."""
    from transformers.utils.generic import is_flash_attention_requested

    config = getattr(unwrap(model), "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl is None:
        return None
    if is_flash_attention_requested(requested_attention_implementation=impl):
        return "varlen"
    return "mask" if impl in ("sdpa", "eager") and not sliding_window_layers(config) else None


def why_not_packed(model) -> str:
    """One line: why `packing_kind(model)` is None."""
    config = getattr(unwrap(model), "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl in ("sdpa", "eager"):
        return f"{type(model).__name__} has sliding-window attention layers, which a packed row's mask does not cover"
    return (f"{type(model).__name__}'s attention {impl!r} does not take packed rows (they need \"sdpa\", \"eager\" "
            "or a flash-attention implementation)")


class PackPlan(NamedTuple):
    """Where each row of a (B, T) batch sits in the (R, C) packed layout; found before the forward."""

    gather: torch.Tensor  # (R * C,) long: the flat position b * T + t each slot holds (0 in a slot that rounds up)
    position_ids: torch.Tensor  # (R, C) long: each row's own positions 0..n-1 (rounding slots: their own run)
    segment: torch.Tensor  # (R, C) long: the row each slot belongs to (rounding slots: B + r)
    index: torch.Tensor  # (N,) long: the slots r * C + c whose hidden states predict the scored tokens
    cu_seqlens: torch.Tensor  # (S + 1,) int32: the S runs' boundaries in the flattened slots (flash's varlen)
    max_seqlen: int  # the longest run
    kind: str  # "mask" or "varlen": the layout it was planned for
    length_buckets: int | None  # sizes per doubling its lengths were rounded to (None: exact)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.position_ids.shape)


def _first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows (longest first) into bins of `capacity` slots, each into the first that has room."""
    bins: list[list[int]] = []
    room: list[int] = []
    for b in sorted(range(len(lengths)), key=lambda b: -lengths[b]):
        r = next((r for r, free in enumerate(room) if lengths[b] <= free), None)
        if r is None:
            bins.append([])
            room.append(capacity)
            r = len(bins) - 1
        bins[r].append(b)
        room[r] -= lengths[b]
    return bins


def plan_packing(mask: torch.Tensor, token_index: torch.Tensor, kind: str = "mask",
                 length_buckets: int | None = None) -> PackPlan:
    """The packed layout of a right-padded batch whose scored tokens `mask` (B, T) marks; waits for the device.

    token_index (N,): the flat positions b * T + t whose hidden states predict them (position t predicts
    token t + 1). Each row keeps its tokens up to its last scored one (the hidden states past it are
    never read); kind: "mask" (rows of the longest row's length) or "varlen" (one row)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is invalid; expected one of {KINDS}")
    B, T = mask.shape
    cols = torch.arange(T, device=mask.device)
    lengths = torch.where(mask.bool(), cols, 0).amax(-1).clamp(min=1).tolist()  # token t needs inputs 0..t-1
    if kind == "varlen":
        bins, C = [list(range(B))], bucket(sum(lengths), length_buckets)
    else:
        C = bucket(max(lengths), length_buckets)
        bins = _first_fit(lengths, C)
        bins += [[] for _ in range(bucket(len(bins), length_buckets) - len(bins))]
    gather, positions, segment, runs, base = [], [], [], [0], [0] * B
    for r, rows in enumerate(bins):
        for b in rows:
            base[b] = len(gather) - b * T  # slot of (b, t) = b * T + t + base[b]
            gather += range(b * T, b * T + lengths[b])
            positions += range(lengths[b])
            segment += [b] * lengths[b]
            runs.append(len(gather))
        tail = (r + 1) * C - len(gather)
        if tail:
            gather += [0] * tail
            positions += range(tail)
            segment += [B + r] * tail
            runs.append(len(gather))
    device, R = mask.device, len(bins)
    base_t = torch.tensor(base, device=device)
    index = token_index + base_t.index_select(0, torch.div(token_index, T, rounding_mode="floor"))
    steps = [b - a for a, b in zip(runs, runs[1:], strict=False)]
    return PackPlan(torch.tensor(gather, device=device), torch.tensor(positions, device=device).view(R, C),
                    torch.tensor(segment, device=device).view(R, C), index,
                    torch.tensor(runs, dtype=torch.int32, device=device), max(steps), kind, length_buckets)


def block_causal_mask(model, segment: torch.Tensor) -> torch.Tensor:
    """(R, 1, C, C): slot q attends to slot k <= q of its own run, as `model`'s "sdpa" / "eager" attention takes it."""
    C = segment.shape[1]
    causal = torch.ones(C, C, dtype=torch.bool, device=segment.device).tril_()
    allowed = (segment[:, :, None] == segment[:, None, :]) & causal  # (R, C, C)
    return mask_for_attention(model, allowed[:, None])


def packed_hidden_states(model, input_ids: torch.Tensor, plan: PackPlan, verify: bool = True) -> torch.Tensor:
    """(N, H) final hidden states that predict the scored tokens of a right-padded (B, T) batch, run packed.

    No host sync: the layout (`plan`) was found before, the mask is built on the device."""
    R, C = plan.shape
    ids = input_ids.reshape(-1).index_select(0, plan.gather).view(R, C)
    if plan.kind == "varlen" or packing_kind(model) == "varlen":
        ids, positions = ids.view(1, R * C), plan.position_ids.view(1, R * C)
        kwargs = dict(attention_mask=None, cu_seq_lens_q=plan.cu_seqlens, cu_seq_lens_k=plan.cu_seqlens,
                      max_length_q=plan.max_seqlen, max_length_k=plan.max_seqlen)
    else:
        positions = plan.position_ids
        kwargs = dict(attention_mask=block_causal_mask(model, plan.segment))
    out = forward_last_logits(model, input_ids=ids, position_ids=positions, output_hidden_states=True,
                              use_cache=False, **kwargs)
    maybe_verify_head(model, out, verify)
    hidden = last_hidden(out)
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, plan.index)


def check_packing(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_index: torch.Tensor,
                  plan: PackPlan) -> None:
    """Once per model: the packed forward's hidden states equal the padded forward's at the scored tokens.

    Both without grad in eval mode; ValueError naming the model when they differ (an attention or a
    position embedding that does not read the packed rows' mask and position ids)."""
    if model in _VERIFIED:
        return
    from SimpleTorchLLMRL.model.scoring.head import final_hidden_states

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = packed_hidden_states(model, input_ids, plan, verify=False).float()
            B, T = input_ids.shape
            plain = final_hidden_states(model, input_ids, attention_mask, verify=False).reshape(B * T, -1)
            plain = plain.index_select(0, token_index).float()
    finally:
        model.train(was_training)
    tol = {torch.float32: 1e-4, torch.float64: 1e-6}.get(next(model.parameters()).dtype, 5e-2)
    err = float((packed - plain).abs().max()) if plain.numel() else 0.0
    if not err <= tol * (1 + float(plain.abs().max())):
        raise ValueError(f"{type(model).__name__}: packed rows give other hidden states than the padded batch (max "
                         f"abs difference {err:.3g}); its attention or positions do not follow the packed rows' mask "
                         "and position ids. Use packed=False.")
    _VERIFIED.add(model)
