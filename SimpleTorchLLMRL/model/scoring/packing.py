"""Padding-free batches: the rows of a batch packed into one, attention kept inside each row.

Legend: B rows, T tokens (padded), L packed slots, S runs, N scored tokens, H hidden size.

A right-padded (B, T) batch of ragged rows spends its body, head and loss on padding. Packed, the rows'
tokens (each up to its last scored one) sit one after another in a (1, L) row, each with its own position
ids 0..n-1, and every attention layer attends within each row only (`packed_attention`, below: the model's flash
varlen kernel, torch's on CUDA, else one `scaled_dot_product_attention` per row), so the forward runs on
real tokens only, plus the slots that round L up (`length_buckets`).

Where each row sits is data (`plan_packing`, a `PackPlan`): finding it waits for the device, so the
trainer finds it before the forward (`prepare`, `split`) and the forward itself never syncs (a placeholder
4D mask keeps HF from building one, whose packed-sequence detection would wait). `packed_hidden_states` is
the forward; `packing_kind` says whether a model's attention takes packed rows; `check_packing` holds a
model's packed forward to its padded one once.

`length_buckets` (k): L and the longest run rounded up to one of k sizes per doubling (`bucket`), so a
compiled body sees a bounded set of shapes over a stream of ragged batches (`torch.compile` of the decoder
layers compiles once per shape).
"""

from __future__ import annotations

import sys
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from SimpleTorchLLMRL.model.scoring.head import (
    check_same_states,
    final_hidden_states,
    forward_last_logits,
    in_eval_without_grad,
    last_hidden,
    maybe_verify_head,
    scoring_forward,
    sliding_window_layers,
    unwrap,
)

# ---- attention over packed rows (Hq / Hkv heads, D head size). HF's attention functions do not read a
# `packed_rows` keyword, so `install` wraps the model's one in transformers' registry (`ALL_ATTENTION_FUNCTIONS`):
# a call with it runs `packed_attention` (the model's flash varlen kernel; torch's on CUDA in half precision;
# else sdpa on each run, its boundaries host ints, out of `torch.compile`'s graphs), any other call (the
# decode, a padded batch, another model) the wrapped function unchanged. The attention costs the sum over
# rows of n^2, not L^2.


class PackedRows(NamedTuple):
    """The runs of one packed row, as the attention reads them."""

    cu_seqlens: torch.Tensor  # (S + 1,) int32 on the device: run boundaries
    bounds: tuple[int, ...] | None  # the same on the host; None on CUDA (a compiled layer would specialize on them)
    max_seqlen: int  # at least the longest run (rounded up with the lengths: fewer shapes to compile)


def _varlen_available(query: torch.Tensor) -> bool:
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_varlen(query, key, value, rows: PackedRows, scaling) -> torch.Tensor:
    """(1, Hq, L, D) -> (1, L, Hq, D) with torch's flash varlen kernel (CUDA, half precision)."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (L, H, D)
    out = varlen_attn(q, k, v, rows.cu_seqlens, rows.cu_seqlens, rows.max_seqlen, rows.max_seqlen, scale=scaling,
                      window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1])
    return out[None]


@torch.compiler.disable
def _each_run(query, key, value, rows: PackedRows, scaling, dropout: float) -> torch.Tensor:
    """(1, Hq, L, D) -> (1, L, Hq, D): causal `scaled_dot_product_attention` on each run."""
    gqa = query.shape[1] != key.shape[1]
    bounds = rows.bounds if rows.bounds is not None else rows.cu_seqlens.tolist()  # CUDA in float32: waits
    parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                            is_causal=True, scale=scaling, enable_gqa=gqa)
             for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    return torch.cat(parts, dim=2).transpose(1, 2)


def packed_attention(original, flash: bool, module, query, key, value, rows: PackedRows, *, scaling=None,
                     dropout=0.0, sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """The attention of one layer over packed rows: (output (1, L, Hq, D), None)."""
    if sliding_window is not None or softcap is not None or s_aux is not None:
        raise ValueError(f"{type(module).__name__}: packed rows do not cover attention with a sliding window, a "
                         "soft-cap or sinks; use packed=False")
    if flash:  # the model's own flash attention: its varlen kernel
        cu = rows.cu_seqlens
        out, _ = original(module, query, key, value, None, scaling=scaling, dropout=dropout, cu_seq_lens_q=cu,
                          cu_seq_lens_k=cu, max_length_q=rows.max_seqlen, max_length_k=rows.max_seqlen, **kwargs)
        return out, None
    if dropout == 0.0 and _varlen_available(query):
        return _torch_varlen(query, key, value, rows, scaling), None
    return _each_run(query, key, value, rows, scaling, dropout), None


def _wrap(name: str, original, flash: bool):
    def attention(module, query, key, value, attention_mask, *args, packed_rows: PackedRows | None = None,
                  **kwargs):
        if packed_rows is None:
            fn = original or sys.modules[type(module).__module__].eager_attention_forward
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        return packed_attention(original, flash, module, query, key, value, packed_rows, **kwargs)

    attention._packed_rows_of = name
    return attention


def install(impl: str) -> None:
    """Wrap the attention function `impl` names in transformers' registry so that it reads `packed_rows`
    (once per process; a call without it runs the wrapped function unchanged)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.utils.generic import is_flash_attention_requested

    current = ALL_ATTENTION_FUNCTIONS.get(impl)
    if getattr(current, "_packed_rows_of", None) == impl:
        return
    flash = is_flash_attention_requested(requested_attention_implementation=impl)
    ALL_ATTENTION_FUNCTIONS[impl] = _wrap(impl, current, flash)  # None for "eager": each model's own, per call


# ---- the packed forward

_VERIFIED: weakref.WeakSet = weakref.WeakSet()  # models whose packed forward was checked against the padded one


def bucket(n: int, steps: int | None) -> int:
    """n rounded up to one of `steps` sizes per doubling (None: n itself); at most 1 / steps of it is added."""
    if steps is None or n <= steps:
        return n
    step = (1 << (n.bit_length() - 1)) // steps  # n >= 2^k: sizes 2^k + j 2^k / steps
    return -(-n // step) * step


def _impl(model) -> str | None:
    return getattr(getattr(unwrap(model), "config", None), "_attn_implementation", None)


def packing_kind(model) -> str | None:
    """How `model`'s attention runs packed rows: "flash" (its flash attention's varlen kernel), "sdpa" (torch's
    varlen kernel on CUDA in half precision, else one sdpa call per row; for "sdpa" and "eager" models without
    sliding-window layers), or None (flex or another attention)."""
    from transformers.utils.generic import is_flash_attention_requested

    impl = _impl(model)
    if impl is None:
        return None
    if is_flash_attention_requested(requested_attention_implementation=impl):
        return "flash"
    config = getattr(unwrap(model), "config", None)
    return "sdpa" if impl in ("sdpa", "eager") and not sliding_window_layers(config) else None


def why_not_packed(model) -> str:
    """One line: why `packing_kind(model)` is None."""
    impl = _impl(model)
    if impl in ("sdpa", "eager"):
        return f"{type(model).__name__} has sliding-window attention layers, which packed rows do not cover"
    return (f"{type(model).__name__}'s attention {impl!r} does not take packed rows (they need \"sdpa\", \"eager\" "
            "or a flash-attention implementation)")


class PackPlan(NamedTuple):
    """Where each row of a (B, T) batch sits in the packed (1, L) row; found before the forward."""

    gather: torch.Tensor  # (L,) long: the flat position b * T + t each slot holds (0 in the rounding slots)
    position_ids: torch.Tensor  # (1, L) long: each row's own positions 0..n-1 (the rounding slots: their own run)
    index: torch.Tensor  # (N,) long: the slots whose hidden states predict the scored tokens, in token_index order
    rows: PackedRows  # the runs' boundaries, as the attention reads them
    length_buckets: int | None  # sizes per doubling its lengths were rounded to (None: exact)

    @property
    def length(self) -> int:
        return int(self.gather.shape[0])


def plan_packing(mask: torch.Tensor, token_index: torch.Tensor, length_buckets: int | None = None) -> PackPlan:
    """The packed layout of a right-padded batch whose scored tokens `mask` (B, T) marks; waits for the device.

    token_index (N,): the flat positions b * T + t whose hidden states predict them (position t predicts
    token t + 1). Each row keeps its tokens up to its last scored one (the hidden states past it are
    never read); L is their sum rounded up by `length_buckets`, the rounding slots one run of their own
    (empty when nothing is rounded)."""
    B, T = mask.shape
    cols = torch.arange(T, device=mask.device)
    lengths = torch.where(mask.bool(), cols, 0).amax(-1).clamp(min=1).tolist()  # token t needs inputs 0..t-1
    total = sum(lengths)
    L = bucket(total, length_buckets)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    bounds.append(L)  # the rounding slots' run, empty without rounding: B + 2 boundaries, one shape per B
    gather = torch.cat([torch.arange(b * T, b * T + n) for b, n in enumerate(lengths)] + [torch.zeros(L - total,
                                                                                                    dtype=torch.long)])
    runs = torch.tensor(bounds)
    positions = torch.arange(L) - runs[:-1].repeat_interleave(runs.diff())  # (L,) 0..n-1 within each run
    device = mask.device
    start = torch.tensor(bounds[:B], device=device) - torch.arange(B, device=device) * T  # slot (b, t): b T + t + start
    index = token_index + start.index_select(0, torch.div(token_index, T, rounding_mode="floor"))
    longest = bucket(max(b - a for a, b in zip(bounds, bounds[1:], strict=False)), length_buckets)
    host = None if device.type == "cuda" else tuple(bounds)  # on CUDA a compiled layer would specialize on them
    rows = PackedRows(runs.to(device=device, dtype=torch.int32), host, longest)
    return PackPlan(gather.to(device), positions.to(device)[None], index, rows, length_buckets)


def packed_hidden_states(model, input_ids: torch.Tensor, plan: PackPlan, verify: bool = True) -> torch.Tensor:
    """(N, H) final hidden states that predict the scored tokens of a right-padded (B, T) batch, run packed.

    No host sync: the layout (`plan`) was found before; a placeholder 4D mask keeps HF from building one."""
    install(_impl(model))
    ids = input_ids.reshape(-1).index_select(0, plan.gather)[None]  # (1, L)
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=ids.device)  # read by nothing: `packed_rows` is
    with scoring_forward():
        out = forward_last_logits(model, input_ids=ids, position_ids=plan.position_ids, attention_mask=placeholder,
                                  packed_rows=plan.rows, output_hidden_states=True, use_cache=False)
    maybe_verify_head(model, out, verify)
    hidden = last_hidden(out)  # (1, L, H)
    return hidden[0].index_select(0, plan.index)


def check_packing(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_index: torch.Tensor,
                  plan: PackPlan) -> None:
    """Once per model: the packed forward's hidden states equal the padded forward's at the scored tokens.

    Both without grad in eval mode; ValueError naming the model when they differ (an attention that does
    not go through transformers' registry, or positions it ignores)."""
    if model in _VERIFIED:
        return
    B, T = input_ids.shape

    def both():
        plain = final_hidden_states(model, input_ids, attention_mask, verify=False).reshape(B * T, -1)
        return packed_hidden_states(model, input_ids, plan, verify=False), plain.index_select(0, token_index)

    packed, plain = in_eval_without_grad(model, both)
    check_same_states(model, packed, plain, "packed rows give other hidden states than the padded batch (max abs "
                      "difference {err}); its attention or positions do not follow the packed rows' boundaries "
                      "and position ids. Use packed=False.")
    _VERIFIED.add(model)
