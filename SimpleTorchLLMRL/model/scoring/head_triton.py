"""Two Triton kernels for the output head's chunk: softmax statistics, and the logits' gradient.

Legend: n tokens in a chunk, V vocab.

The "gpu" chunk kernel (`logprobs._DeviceChunks`) spends most of its time in whole-chunk
elementwise passes over the (n, V) float32 logits (log-softmax, exp, the entropy's
product, the gradient's multiply, scatter and cast): about a dozen reads and writes of
n x V x 4 bytes, each its own launch. These two kernels do the same work in two reads:

- `row_stats`: one pass over each row of z (n, V) -> log p(y), entropy and logsumexp,
  with an online (running max) softmax in float32; temperature applied on the fly;
- `row_grad`: one pass -> g = c (onehot(y) - p) - c_H p (log p + H) (n, V), p = softmax(z),
  written straight in the head's dtype (bf16 on GPUs) for the two gradient GEMMs, where
  c (n,) = dL/dlogp / T and c_H (n,) = dL/dentropy / T (the entropy term only when a loss uses it).

On CUDA tensors they are compiled by `triton.jit`. On CPU tensors they run only in Triton's
interpreter, i.e. in a process started with TRITON_INTERPRET=1 (read when Triton is first
imported); it is slow and exists so that CI checks the kernels' numerics without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: `available()` says so and the "gpu" kernel is used instead
    triton = tl = None

BLOCK = 4096  # vocab entries per loop step of a row
NUM_WARPS = 16


def available() -> bool:
    return triton is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 when it was imported)."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if triton is not None:

    def _row_stats(z_ptr, y_ptr, logp_ptr, ent_ptr, lse_ptr, cut_ptr, V, stride, inv_temp, BLOCK: tl.constexpr,
                   HAS_CUT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * stride
        if HAS_CUT:
            cut = tl.load(cut_ptr + row)
        m = tl.full((), -3.0e38, tl.float32)  # running max (finite, so m - m_new never is -inf - -inf)
        s = tl.full((), 0.0, tl.float32)  # sum exp(x - m)
        t = tl.full((), 0.0, tl.float32)  # sum exp(x - m) * (x - m)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temp
            if HAS_CUT:  # outside the kept set of top-k / top-p / min-p: no mass
                x = tl.where(x >= cut, x, -float("inf"))
            m_new = tl.maximum(m, tl.max(x, 0))
            a = tl.exp(m - m_new)
            e = tl.exp(x - m_new)
            d = tl.where(e > 0, x - m_new, 0.0)
            t = a * (t + (m - m_new) * s) + tl.sum(e * d, 0)
            s = a * s + tl.sum(e, 0)
            m = m_new
        lse = m + tl.log(s)
        y = tl.load(y_ptr + row)
        x_y = tl.load(base + y).to(tl.float32) * inv_temp
        tl.store(logp_ptr + row, x_y - lse)
        tl.store(ent_ptr + row, tl.log(s) - t / s)  # H = log S - E_p[x - m]
        tl.store(lse_ptr + row, lse)

    def _row_grad(z_ptr, y_ptr, lse_ptr, c_ptr, g_ptr, ent_ptr, ce_ptr, cut_ptr, V, z_stride, g_stride, inv_temp,
                  BLOCK: tl.constexpr, HAS_ENT: tl.constexpr, HAS_CUT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        if HAS_CUT:
            cut = tl.load(cut_ptr + row)
        lse = tl.load(lse_ptr + row)
        c = tl.load(c_ptr + row)
        y = tl.load(y_ptr + row)
        if HAS_ENT:
            h = tl.load(ent_ptr + row)
            ce = tl.load(ce_ptr + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(z_ptr + row * z_stride + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp
            p = tl.exp(x - lse)
            if HAS_CUT:  # p is 0 outside the kept set (x stays finite: p * (log p + H) is 0 there, not NaN)
                p = tl.where(x >= cut, p, 0.0)
            if HAS_ENT:  # + dL/dH * dH/dz, dH/dz = -p (log p + H)
                g = tl.where(cols == y, c, 0.0) - p * (c + ce * (x - lse + h))
            else:
                g = tl.where(cols == y, c, 0.0) - c * p
            tl.store(g_ptr + row * g_stride + cols, g.to(g_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _kernels():
    """(row_stats, row_grad), jitted on first use (interpreted under TRITON_INTERPRET=1)."""
    return triton.jit(_row_stats), triton.jit(_row_grad)


def check_device(device: torch.device) -> None:
    """Raise with the reason when the kernels cannot run on tensors of `device`."""
    if triton is None:
        raise RuntimeError("head_impl='triton' needs the triton package (it ships with CUDA builds of torch)")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(f"head_impl='triton' runs on CUDA tensors, got {device.type} ones (on a CPU its "
                           "kernels run only in Triton's interpreter: TRITON_INTERPRET=1 before triton is imported)")


def _launch(kernel, n: int, args, device: torch.device, **constants) -> None:
    check_device(device)
    fn = _kernels()[kernel]
    if device.type == "cuda":
        with torch.cuda.device(device):
            fn[(n,)](*args, BLOCK=BLOCK, num_warps=NUM_WARPS, **constants)
    else:
        fn[(n,)](*args, BLOCK=BLOCK, **constants)


def row_stats(z: torch.Tensor, y: torch.Tensor, inv_temp: float, cut: torch.Tensor | None = None):
    """z (n, V) logits (row-contiguous), y (n,) -> logp (n,), entropy (n,), logsumexp (n,), all float32.

    Everything is of the logits times inv_temp; cut (n,) float32 | None: only entries with
    z * inv_temp >= cut count (the truncated distribution, `model/scoring/truncation.py`).
    """
    if z.stride(1) != 1:
        raise ValueError("row_stats needs logits whose rows are contiguous")
    n, V = z.shape
    logp, ent, lse = (torch.empty(n, dtype=torch.float32, device=z.device) for _ in range(3))
    if n:
        has_cut = cut is not None
        cut = cut.float().contiguous() if has_cut else lse  # unread without a cut
        _launch(0, n, (z, y, logp, ent, lse, cut, V, z.stride(0), float(inv_temp)), z.device, HAS_CUT=has_cut)
    return logp, ent, lse


def row_grad(z: torch.Tensor, y: torch.Tensor, lse: torch.Tensor, c: torch.Tensor, inv_temp: float,
             out: torch.Tensor, ent: torch.Tensor | None = None, c_ent: torch.Tensor | None = None,
             cut: torch.Tensor | None = None) -> torch.Tensor:
    """out (n, V) := c (onehot(y) - p) - c_ent p (log p + H), p = softmax(z * inv_temp), in out's dtype.

    lse (n,) and ent (n,) (H) from `row_stats`; c (n,) and c_ent (n,) float32 (the latter None:
    no entropy term, and ent is not read). cut (n,) | None: as `row_stats` (p = 0 below it). Returns out.
    """
    n, V = z.shape
    if out.shape != z.shape or out.stride(1) != 1:
        raise ValueError(f"row_grad writes a row-contiguous {tuple(z.shape)} tensor, got {tuple(out.shape)}")
    if (ent is None) != (c_ent is None):
        raise ValueError("row_grad takes the entropy H and its coefficient c_ent together, or neither")
    has_ent = c_ent is not None
    c = c.float().contiguous()
    ent, c_ent = (ent.float().contiguous(), c_ent.float().contiguous()) if has_ent else (c, c)  # unread if not
    has_cut = cut is not None
    cut = cut.float().contiguous() if has_cut else c  # unread without a cut
    if n:
        _launch(1, n, (z, y, lse, c, out, ent, c_ent, cut, V, z.stride(0), out.stride(0), float(inv_temp)), z.device,
                HAS_ENT=has_ent, HAS_CUT=has_cut)
    return out
