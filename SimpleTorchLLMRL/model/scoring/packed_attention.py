"""Attention over packed rows: each row attends causally to itself only, given the rows' boundaries.

Legend: L packed tokens, S runs (the rows, and the slots that round the pack up), Hq / Hkv heads, D head size.

A packed forward (`model.scoring.packing`) hands every attention layer a `PackedRows` keyword (the runs'
boundaries, found before the forward) and a placeholder 4D mask, so HF builds no mask of its own (its
packed-sequence detection would wait for the device). HF's attention functions do not read such a keyword,
so `install` wraps the model's one in transformers' registry (`ALL_ATTENTION_FUNCTIONS`, the mechanism HF
offers for overriding an attention locally): a call with `packed_rows` runs here, any other call (the
decode, a padded batch, another model) runs the wrapped function unchanged.

    flash attention (the model's)   its varlen kernel, with `cu_seq_lens_q` / `_k`, `max_length_q` / `_k`
    CUDA, bf16 / fp16               torch's own flash varlen kernel (`torch.nn.attention.varlen.varlen_attn`)
    otherwise (CPU, float32)        `scaled_dot_product_attention` on each run (the runs' boundaries are host
                                    ints: no sync; kept out of `torch.compile`'s graphs; on CUDA, where the plan
                                    keeps them on the device only, reading them waits once per layer)

So the attention costs the sum over rows of n^2, not L^2, and nothing is padded but the rounding run.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F


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
