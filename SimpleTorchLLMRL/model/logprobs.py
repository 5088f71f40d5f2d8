"""Per-token log-probs and entropy of the next token, computed in chunks.

Legend: B batch, T tokens, H hidden size, V vocab, N selected positions, n chunk.

Per-token tensors are (B, T) and ALIGNED WITH input_ids:
`logp[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`; column 0 is 0 (nothing
predicts the first token), so they line up with `loss_mask` and `sampler_logprobs`.

A full (B, T, V) float32 log-softmax is never built. The model runs once to
its final hidden states (`output_hidden_states=True, logits_to_keep=1`, so the
model's own head only scores the last position), then the output embedding
scores chunks of `chunk_size` positions at a time:

- plain `nn.Linear` head: a custom autograd function keeps only the hidden
  states; backward recomputes one chunk of logits at a time. When the head's
  weight is frozen (LoRA) the per-token Jacobian d logp / d h (N, H) is built
  in the forward pass, so backward costs no extra matmul.
- `fused_token_loss`: when the loss is a sum of per-token terms whose only
  variable is logp (GRPO at token level), the gradient is known as soon as a
  chunk is scored, so it is chained into the hidden-state / weight gradients
  right away: three matmuls in all, like the naive path, one chunk in memory.
- any other head (peft-wrapped, quantized, soft-capped logits): each chunk runs
  under `torch.utils.checkpoint`, so backward keeps one chunk's logits at a time.

Three kernels score a chunk, chosen by one switch, `head_impl`:

- "cpu": row blocks inside a chunk whose float32 scratch stays under glibc's mmap
  threshold (fast on CPUs, where fresh large blocks are page-faulted on every use);
- "gpu": whole-chunk ops, the head's matmuls in its own dtype (bf16 tensor cores)
  with float32 accumulation and float32 softmax statistics, chunks sized by bytes
  (`GPU_CHUNK_BYTES` of logits) rather than by a token count: a handful of
  large kernels per chunk and no per-row Python loop on the device.

- "triton": the "gpu" kernel's GEMMs with its elementwise passes replaced by two Triton
  kernels (`head_triton`): one read of the logits for the softmax statistics, one that
  writes their gradient in the head's dtype.

"auto" (the default) takes "triton" for CUDA tensors ("gpu" when Triton is missing) and
"cpu" otherwise. "gpu" runs on the CPU too, and "triton" does in Triton's interpreter
(TRITON_INTERPRET=1), so the numerics of both are tested without a GPU.

Entropy is a diagnostic: it is returned detached.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from SimpleTorchLLMRL.model import head_triton
from SimpleTorchLLMRL.model.shared_prefix import (
    PrefixPlan,
    causal_mask_4d,
    check_shared_prefix,
    first_positions,
    forward_last_logits,
    last_hidden,
    plan_shared_prefix,
    shared_prefix_hidden_states,
)
from SimpleTorchLLMRL.utils.warn import warn_user

DEFAULT_CHUNK_SIZE = None  # None: 512 tokens on the "cpu" kernel, GPU_CHUNK_BYTES of logits on "gpu" / "triton"
CPU_CHUNK_SIZE = 512
# float32 logits per chunk of the "gpu" and "triton" kernels. Measured on an H100 (Qwen2.5-0.5B, 33k tokens,
# "triton"): 128 / 256 / 512 / 1024 MiB took 0.74 / 0.62 / 0.49 / 0.48 s per loss + backward, the same peak
# up to 512 MiB (docs/benchmarks.md#gpu): each chunk pays a fixed cost (its loss terms, kernel launches,
# one read-modify-write of the float32 weight gradient).
GPU_CHUNK_BYTES = 512 * 2**20
HEAD_IMPLS = ("auto", "cpu", "gpu", "triton")
SCRATCH_BYTES = 16 * 2**20  # row blocks for the softmax sums inside a chunk stay under glibc's mmap threshold
_VERIFIED: weakref.WeakSet = weakref.WeakSet()  # models whose head was checked once


class TokenLogProbs(NamedTuple):
    """What `token_logprobs` returns when asked for more than the log-probs. All (B, T) but hidden."""

    logprobs: torch.Tensor  # (B, T) float32
    entropy: torch.Tensor | None  # (B, T) float32, detached
    hidden_states: torch.Tensor | None  # (B, T, H) final hidden states (after the final norm)


def _unwrap(model):
    """DDP / torch.compile wrappers -> the module that has `config` and the output embedding."""
    while hasattr(model, "module") and not hasattr(model, "get_output_embeddings"):
        model = model.module
    return getattr(model, "_orig_mod", model)


def output_head(model) -> nn.Module:
    """The output embedding (lm_head) of a causal LM, peft-wrapped or not."""
    head = _unwrap(model).get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (get_output_embeddings() is None)")
    return head


def model_vocab_size(model) -> int | None:
    """Rows of the output head (the ids the model can score), None when the model has no readable head."""
    try:
        head = output_head(model)
    except (AttributeError, ValueError):
        return None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None


def check_vocabulary(model, tokenizer) -> None:
    """A tokenizer with more ids than the model scores is an error; a much smaller one is a warning.

    Models often pad their embedding past the tokenizer (Qwen2.5: 151,936 rows for 151,665
    tokens), so a small surplus is normal; a surplus of more than max(2048, 5%) usually means
    the tokenizer belongs to another model, whose ids mean other words to this one.
    """
    n_model, n_tok = model_vocab_size(model), len(tokenizer) if hasattr(tokenizer, "__len__") else None
    if n_model is None or n_tok is None:
        return
    if n_tok > n_model:
        raise ValueError(f"the tokenizer has {n_tok} tokens but the model scores only {n_model}: ids >= {n_model} "
                         "would index past its embedding. Use the model's own tokenizer, or after adding "
                         "tokens call model.resize_token_embeddings(len(tokenizer)).")
    if n_model - n_tok > max(2048, n_tok // 20):
        warn_user(f"the model scores {n_model} token ids but the tokenizer has only {n_tok}: is it the model's own "
                  "tokenizer? A tokenizer of another model maps its ids to other words (this is a warning only "
                  "because some models pad their embedding generously).")


def logit_softcap(model) -> float | None:
    """`final_logit_softcapping` of Gemma-2-style configs, else None."""
    config = getattr(_unwrap(model), "config", None)
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def final_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        verify: bool = True, start: torch.Tensor | None = None, *,
                        prefix_plan: PrefixPlan | None = None, right_padded: bool = False) -> torch.Tensor:
    """(B, T, H) hidden states that the model's output embedding turns into logits.

    One forward through the whole model (so DDP / FSDP / peft hooks run) with
    `logits_to_keep=1`: the model's own head scores only the last position,
    which also lets us check once per model that `head(hidden_states[-1])`
    really are its logits (a model that post-processes logits otherwise
    raises instead of silently giving wrong log-probs).

    start (B,) long, with a right-padded attention_mask: only positions >= start are
    needed, so rows with identical tokens before `start` run that prefix once
    (`shared_prefix`); positions before `start` are then 0. Checked once per model
    against the plain forward. prefix_plan: `plan_shared_prefix(input_ids, attention_mask,
    start)` found before the forward (else found here, which waits for the device).
    right_padded: the batch is right-padded (a `Batch` is), so the plain forward takes a causal
    mask that HF does not read for padding (`right_padded_attention`: no host sync).
    """
    if prefix_plan is None and start is not None and attention_mask is not None:
        prefix_plan = plan_shared_prefix(input_ids, attention_mask, start)
    if prefix_plan is not None and prefix_plan.group is not None:
        if verify:
            check_shared_prefix(model, input_ids, attention_mask, prefix_plan.start)
        shared = shared_prefix_hidden_states(model, input_ids, attention_mask, prefix_plan.start, plan=prefix_plan)
        if shared is not None:
            hidden, out = shared
            _maybe_verify_head(model, out, verify)  # against the suffix forward's own last position
            return hidden
    mask = right_padded_attention(model, attention_mask) if right_padded else attention_mask
    out = forward_last_logits(model, input_ids=input_ids, attention_mask=mask, output_hidden_states=True,
                              use_cache=False)
    _maybe_verify_head(model, out, verify)
    return last_hidden(out)


def right_padded_attention(model, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """What to pass as `attention_mask` for a RIGHT-padded batch so that the forward never waits for the device.

    Padding sits after every real token, so causality alone keeps it out of every real position
    (padded positions get other hidden states, which nobody scores). HF reads a 2D mask for
    padding, and without one the position ids for packing, with a host sync in each forward; a
    4D mask it uses as given. So this is a (1, 1, T, T) causal mask (`shared_prefix.causal_mask_4d`)
    where the model's attention takes one, else the 2D mask as it is.
    """
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    causal = causal_mask_4d(_unwrap(model), attention_mask.new_ones(1, attention_mask.shape[1]))
    return attention_mask if causal is None else causal


def _maybe_verify_head(model, out, verify: bool) -> None:
    logits = getattr(out, "logits", None)
    if verify and logits is not None and _unwrap(model) not in _VERIFIED:
        _verify_head(model, last_hidden(out), logits)


def _verify_head(model, hidden: torch.Tensor, logits: torch.Tensor) -> None:
    with torch.no_grad():
        mine = _head_logits(output_head(model), hidden[:, -1:], logit_softcap(model))  # (B, 1, V)
        theirs = logits[:, -1:].float()
        tol = 1e-4 if theirs.dtype == torch.float32 and hidden.dtype == torch.float32 else 5e-2
        if mine.shape != theirs.shape or not torch.allclose(mine, theirs, atol=tol * (1 + theirs.abs().max()), rtol=0):
            raise ValueError(
                f"{type(model).__name__}: output_embeddings(hidden_states[-1]) does not reproduce the model's "
                "logits (it post-processes them in a way token_logprobs does not know); chunked log-probs "
                "would be wrong for this model"
            )
    _VERIFIED.add(_unwrap(model))


def _head_logits(head: nn.Module, h: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """(..., H) -> (..., V) float32 logits, soft-capped like the model does."""
    z = head(h).float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z


class _LinearChunks:
    """The "cpu" kernel: a plain-Linear head scored chunk by chunk, logits in float32 / temperature.

    Every kernel answers three questions about a chunk of n tokens (hc (n, H), yc (n,)):
    `score` (pass 1: log p(y), entropy, logsumexp), `grad_logits` (pass 2: dL/dz from the
    per-token dL/dlogp and dL/dentropy, the logits recomputed) and `accumulate` (dL/dz into
    the hidden-state, weight and bias gradients).
    """

    def __init__(self, weight, bias, inv_temp: float, upcast: bool, need=(False, False, False), like=None):
        self.W = weight.float() if upcast else weight
        self.b = None if bias is None else bias.to(self.W.dtype)
        self.inv_temp = inv_temp
        self._z = self._scratch = None  # (n, V) logits buffer and (rows, V) scratch, reused across chunks
        need_h, need_w, need_b = need
        self.grad_h = torch.empty_like(like) if need_h else None  # (N, H): every row is written once
        self.grad_w = torch.zeros(self.W.shape, dtype=torch.float32, device=self.W.device) if need_w else None
        self.grad_b = torch.zeros(self.W.shape[0], dtype=torch.float32, device=self.W.device) if need_b else None

    def _logits(self, hc: torch.Tensor) -> torch.Tensor:
        """(n, H) -> (n, V) float32 logits / temperature, in the buffer reused by every chunk of this call."""
        n, V = hc.shape[0], self.W.shape[0]
        if self._z is None or self._z.shape[0] < n:
            self._z = torch.empty((n, V), dtype=torch.float32, device=hc.device)
        z = self._z[:n]  # (n, V)
        h = hc.to(self.W.dtype)
        if self.W.dtype != torch.float32:
            z.copy_(F.linear(h, self.W, self.b))
        elif self.b is None:
            torch.mm(h, self.W.t(), out=z)
        else:
            torch.addmm(self.b, h, self.W.t(), out=z)
        if self.inv_temp != 1.0:
            z.mul_(self.inv_temp)
        return z

    def score(self, hc: torch.Tensor, yc: torch.Tensor, probs: bool, entropy: bool):
        """hc (n, H), yc (n,) -> logp (n,), entropy (n,) | None, logsumexp (n,), softmax p (n, V) | None.

        The row blocks leave exp(z - m) in the logits buffer, so p is one multiply by 1 / S.
        The row-wise sums use one (rows, V) scratch of <= SCRATCH_BYTES: fresh blocks
        over 32 MiB are mmapped by glibc and page-faulted on every allocation.
        """
        z = self._logits(hc)  # (n, V)
        n, V = z.shape
        logit_y = z.gather(1, yc[:, None]).squeeze(1)  # (n,)
        m = z.amax(dim=-1)  # (n,)
        total = torch.empty_like(m)  # S = sum_v exp(z - m)
        ent = torch.empty_like(m) if entropy else None
        rows = max(1, SCRATCH_BYTES // (4 * V))
        if entropy and (self._scratch is None or self._scratch.shape[0] < min(rows, n)):
            self._scratch = torch.empty((min(rows, n), V), dtype=torch.float32, device=hc.device)
        for blk in _chunks(n, rows):
            zb = z[blk]
            if entropy:  # H = log S - sum_v e_v (z_v - m) / S
                d = torch.sub(zb, m[blk, None], out=self._scratch[: zb.shape[0]])  # (rows, V) z - m
                eb = torch.exp(d, out=zb)  # z's rows now hold e = exp(z - m)
                total[blk] = eb.sum(-1)
                ent[blk] = total[blk].log() - torch.bmm(eb.unsqueeze(1), d.unsqueeze(2)).view(-1) / total[blk]
            else:
                total[blk] = zb.sub_(m[blk, None]).exp_().sum(-1)
        lse = m + total.log()
        p = z.mul_(total.reciprocal()[:, None]) if probs else None  # e / S
        return logit_y - lse, ent, lse, p

    def grad_logits(self, hc, yc, lse, ent, c_lp, c_ent) -> torch.Tensor:
        """Pass 2: dL/dz (n, V) of the chunk's raw logits, recomputed from hc and pass 1's lse / entropy (n,).

        c_lp (n,) = dL/dlogp, c_ent (n,) | None = dL/dentropy. With p = softmax and
        log p = z / T - lse: dL/dz = (c_lp (onehot(y) - p) - c_ent p (log p + H)) / T.
        """
        logsm = self._logits(hc).sub_(lse[:, None])  # (n, V) log-softmax, in the logits buffer
        return _softmax_grad(logsm, yc, ent, c_lp, c_ent, self.inv_temp)

    def free_buffers(self) -> None:
        self._z = self._scratch = None

    def dlogp_dlogits(self, p: torch.Tensor, yc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Consumes p: scale * d logp / d z = scale * (onehot(y) - p), times 1/temperature, (n, V)."""
        s = (scale * self.inv_temp)[:, None]  # (n, 1)
        return p.mul_(-s).scatter_add_(1, yc[:, None], s)

    def accumulate(self, g: torch.Tensor, hc: torch.Tensor, sl: slice) -> None:
        """Chain g = dL/dz (n, V) into the hidden-state, weight and bias gradients."""
        if self.grad_h is not None:
            self.grad_h[sl] = (g.to(self.W.dtype) @ self.W).to(self.grad_h.dtype)
        if self.grad_w is not None:
            self.grad_w.addmm_(g.t(), hc.float())
        if self.grad_b is not None:
            self.grad_b += g.sum(0)

    def grads(self, weight, bias, scale=None):
        """(grad_h, grad_w, grad_b) in the parameters' dtypes, optionally times a scalar (a tensor: no sync)."""
        out = []
        for g, like in ((self.grad_h, None), (self.grad_w, weight), (self.grad_b, bias)):
            if g is not None and scale is not None:
                g = g.mul_(scale)
            out.append(g if g is None or like is None else g.to(like.dtype))
        return tuple(out)


def _softmax_grad(logsm: torch.Tensor, yc: torch.Tensor, ent: torch.Tensor | None, c_lp: torch.Tensor,
                  c_ent: torch.Tensor | None, inv_temp: float) -> torch.Tensor:
    """Consumes logsm (n, V) float32 log-softmax: dL/dz = (c_lp (onehot(y) - p) - c_ent p (log p + H)) / T."""
    c = (c_lp * inv_temp)[:, None]  # (n, 1)
    if c_ent is None:  # the usual case: 3 passes (exp, scale, scatter)
        g = logsm.exp_().mul_(-c)
    else:  # -p (c_lp + c_ent (log p + H)) / T
        p = logsm.exp()
        g = logsm.add_(ent[:, None]).mul_((c_ent * inv_temp)[:, None]).add_(c).mul_(p).neg_()
    return g.scatter_add_(1, yc[:, None], c)


class _DeviceChunks(_LinearChunks):
    """The "gpu" kernel: whole-chunk ops; matmuls in the head's dtype, accumulated and returned in float32.

    Per chunk, pass 1: one logits GEMM, logsumexp, one exp, one product-sum for the entropy;
    pass 2: the logits GEMM again, exp(z - lse), the gradient's scale and scatter, two GEMMs
    (d hidden, d weight accumulated in place in float32). On CPU the float32-output GEMM is not
    available and the logits are rounded to the head's dtype first.
    """

    def logits(self, hc: torch.Tensor) -> torch.Tensor:
        """(n, H) -> (n, V) float32 logits, temperature not applied."""
        z = _mm_f32(hc.to(self.W.dtype), self.W.t())
        if self.b is not None:
            z += self.b.float()
        return z

    def _logits(self, hc: torch.Tensor) -> torch.Tensor:
        z = self.logits(hc)
        return z.mul_(self.inv_temp) if self.inv_temp != 1.0 else z

    def score(self, hc: torch.Tensor, yc: torch.Tensor, probs: bool, entropy: bool):
        z = self._logits(hc)  # (n, V) float32
        logit_y = z.gather(1, yc[:, None]).squeeze(1)  # (n,)
        lse = torch.logsumexp(z, dim=-1)  # (n,)
        logsm = z.sub_(lse[:, None])  # (n, V) log-softmax, in place
        p = logsm.exp() if (probs or entropy) else None  # (n, V)
        ent = -torch.linalg.vecdot(p, logsm) if entropy else None  # (n,)
        return logit_y - lse, ent, lse, p

    def accumulate(self, g: torch.Tensor, hc: torch.Tensor, sl: slice) -> None:
        low = g.to(self.W.dtype)  # (n, V): the GEMMs run on tensor cores when the head is bf16 / fp16
        if self.grad_h is not None:
            self.grad_h[sl] = _mm_f32(low, self.W).to(self.grad_h.dtype)
        if self.grad_w is not None:
            _addmm_f32_(self.grad_w, low.t(), hc.to(self.W.dtype))
        if self.grad_b is not None:
            self.grad_b += g.sum(0)


class _TritonChunks(_DeviceChunks):
    """The "triton" kernel: the "gpu" kernel's GEMMs, its elementwise passes done by `head_triton`.

    Per chunk: the logits GEMM (float32 output), one read for log p(y) / entropy / logsumexp
    (`row_stats`), and when a gradient is needed one more read that writes
    dL/dz in the head's dtype (`row_grad`) for the two gradient GEMMs.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._g = None  # (n, V) gradient buffer in the head's dtype, reused across chunks

    def score(self, hc: torch.Tensor, yc: torch.Tensor, probs: bool, entropy: bool):
        z = self.logits(hc)  # (n, V) float32; row_stats applies the temperature
        logp, ent, lse = head_triton.row_stats(z, yc, self.inv_temp)
        return logp, ent if entropy else None, lse, (z, lse) if probs else None

    def _grad_buffer(self, z: torch.Tensor) -> torch.Tensor:
        if self._g is None or self._g.shape[0] < z.shape[0]:
            self._g = torch.empty(z.shape, dtype=self.W.dtype, device=z.device)
        return self._g[: z.shape[0]]

    def dlogp_dlogits(self, p, yc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        z, lse = p
        return head_triton.row_grad(z, yc, lse, scale * self.inv_temp, self.inv_temp, out=self._grad_buffer(z))

    def grad_logits(self, hc, yc, lse, ent, c_lp, c_ent) -> torch.Tensor:
        z = self.logits(hc)  # (n, V) float32, temperature applied inside the kernel
        ent, c_ent = (None, None) if c_ent is None else (ent, c_ent * self.inv_temp)
        return head_triton.row_grad(z, yc, lse, c_lp * self.inv_temp, self.inv_temp, out=self._grad_buffer(z),
                                    ent=ent, c_ent=c_ent)

    def free_buffers(self) -> None:
        super().free_buffers()
        self._g = None


_F32_OUT = {"ok": True}  # CUDA GEMMs with a float32 output (torch >= 2.8); off after the first refusal


def _f32_out(a: torch.Tensor) -> bool:
    return _F32_OUT["ok"] and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as float32, accumulated in float32 (CUDA: one GEMM with a float32 output, no rounding to bf16)."""
    if _f32_out(a):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            _F32_OUT["ok"] = False
    return torch.mm(a, b).float()


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in place, acc float32, a and b in the head's dtype."""
    if _f32_out(a):
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):
            _F32_OUT["ok"] = False
    acc.add_(torch.mm(a, b))


def resolve_head_impl(impl: str, device: torch.device) -> str:
    """The chunk kernel that `head_impl` names for tensors on `device`: "cpu", "gpu" or "triton"."""
    if impl not in HEAD_IMPLS:
        raise ValueError(f"head_impl={impl!r} is invalid; expected one of {HEAD_IMPLS}")
    if impl == "auto":
        return ("triton" if head_triton.available() else "gpu") if device.type == "cuda" else "cpu"
    return impl


def _kernel(impl: str, device: torch.device):
    """The chunk kernel class of `head_impl` for tensors on `device`."""
    impl = resolve_head_impl(impl, device)
    if impl == "triton":
        head_triton.check_device(device)
    return {"cpu": _LinearChunks, "gpu": _DeviceChunks, "triton": _TritonChunks}[impl]


def _chunk_tokens(kernel, chunk_size: int | None, vocab: int) -> int:
    """Tokens per chunk: the caller's, else 512 on the cpu kernel, GPU_CHUNK_BYTES of float32 logits on gpu."""
    if chunk_size is not None:
        return chunk_size
    if issubclass(kernel, _DeviceChunks):
        return max(64, GPU_CHUNK_BYTES // (4 * vocab) // 64 * 64)
    return CPU_CHUNK_SIZE


def _chunks(n: int, size: int):
    return [slice(s, s + size) for s in range(0, n, size)]


class _TwoPassHead(torch.autograd.Function):
    """logp, entropy of targets under softmax((h W^T + b) / temperature): two passes, one autograd node.

    Pass 1 (forward, no autograd): every chunk's logits -> log p(y), entropy and logsumexp,
    (N,) float32 each; nothing of size V is kept. Whatever loss the caller builds on logp and
    entropy runs once on those (N,) tensors with autograd and hands back dL/dlogp and
    dL/dentropy per token. Pass 2 (backward) recomputes each chunk's logits and forms
    dL/dz = dL/dlogp (onehot - p) - dL/dH p (log p + H) straight into the GEMMs for d hidden
    and d weight (float32 accumulation). No loss closure and no autograd graph per chunk.

    With `jacobian` (frozen head, hidden states need a gradient) pass 1 also stores
    d logp / d h (N, H), so a backward that needs no entropy gradient is one product.
    """

    @staticmethod
    def forward(ctx, h, weight, bias, y, inv_temp, chunk_size, upcast, jacobian, impl):
        # h (N, H), weight (V, H), bias (V,) | None, y (N,)
        kernel = _kernel(impl, h.device)
        chunk_size = _chunk_tokens(kernel, chunk_size, weight.shape[0])
        head = kernel(weight, bias, inv_temp, upcast, need=(jacobian, False, False), like=h.float())
        logp, ent, lse = [], [], []
        for sl in _chunks(h.shape[0], chunk_size):
            hc, yc = h[sl], y[sl]
            lp_c, ent_c, lse_c, p = head.score(hc, yc, probs=jacobian, entropy=True)
            if jacobian:
                head.accumulate(head.dlogp_dlogits(p, yc, torch.ones_like(lp_c)), hc, sl)
            del p
            logp.append(lp_c), ent.append(ent_c), lse.append(lse_c)
        logp, ent, lse = (_cat(t, h) for t in (logp, ent, lse))  # (N,) float32 each
        head.free_buffers()
        ctx.save_for_backward(h, weight, bias, y, lse, ent, head.grad_h)
        ctx.inv_temp, ctx.chunk_size, ctx.upcast, ctx.kernel = inv_temp, chunk_size, upcast, kernel
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        h, weight, bias, y, lse, ent, jac = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        nones = (None,) * 6
        if grad_logp is None and grad_ent is None:
            return None, None, None, *nones
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if jac is not None and grad_ent is None and not (need[1] or need[2]):
            return (grad_logp[:, None] * jac).to(h.dtype), None, None, *nones
        head = ctx.kernel(weight, bias, ctx.inv_temp, ctx.upcast, need=need, like=h)
        c_lp, c_ent = grad_logp.float(), None if grad_ent is None else grad_ent.float()
        for sl in _chunks(h.shape[0], ctx.chunk_size):
            g = head.grad_logits(h[sl], y[sl], lse[sl], ent[sl], c_lp[sl], None if c_ent is None else c_ent[sl])
            head.accumulate(g, h[sl], sl)
        return *head.grads(weight, bias), None, *nones[:5]


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The (N,) per-token statistics of the chunks, one tensor (a chunk list of one is returned as it is)."""
    if not parts:
        return like.new_zeros(0, dtype=torch.float32)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _FusedTokenLoss(torch.autograd.Function):
    """sum_i token_loss(logp_i): gradients are computed chunk by chunk in the forward pass.

    Possible because every input of the per-token loss except logp itself is a
    constant, so dL/dlogp is known as soon as a chunk's logp is: three matmuls
    in all (like the naive path) and one chunk of logits in memory, but an
    autograd graph of the loss per chunk (`fused=True`; the default is `_TwoPassHead`).
    """

    @staticmethod
    def forward(ctx, h, weight, bias, y, token_loss, inv_temp, chunk_size, upcast, need, impl):
        kernel = _kernel(impl, h.device)
        chunk_size = _chunk_tokens(kernel, chunk_size, weight.shape[0])
        head = kernel(weight, bias, inv_temp, upcast, need=need, like=h)
        logp, ent, losses = [], [], []
        for sl in _chunks(h.shape[0], chunk_size):
            hc, yc = h[sl], y[sl]
            lp, ent_c, _, p = head.score(hc, yc, probs=True, entropy=True)
            with torch.enable_grad():
                leaf = lp.detach().requires_grad_()
                loss = token_loss(leaf, sl).sum()
                dl = torch.autograd.grad(loss, leaf)[0] if any(need) and loss.requires_grad else None
            losses.append(loss.detach().float())
            if dl is not None:
                head.accumulate(head.dlogp_dlogits(p, yc, dl.float()), hc, sl)
            del p
            logp.append(lp), ent.append(ent_c)
        head.free_buffers()  # only the gradients are kept for backward
        ctx.head = head
        ctx.params = (weight, bias)
        logp, ent = _cat(logp, h), _cat(ent, h)
        total = torch.stack(losses).sum() if losses else h.new_zeros((), dtype=torch.float32)
        ctx.mark_non_differentiable(logp, ent)
        return total, logp, ent

    @staticmethod
    def backward(ctx, grad_total, _grad_logp, _grad_ent):
        grads = ctx.head.grads(*ctx.params, scale=grad_total)  # a tensor: no host sync to test it for 1.0
        del ctx.head
        return *grads, None, None, None, None, None, None, None


def _generic_chunk(head, softcap, inv_temp):
    def run(hc, yc):
        z = _head_logits(head, hc, softcap) * inv_temp  # (n, V)
        lse = torch.logsumexp(z, dim=-1)
        logp = z.gather(1, yc[:, None]).squeeze(1) - lse
        logsm = z - lse[:, None]
        ent = -torch.bmm(logsm.exp().unsqueeze(1), logsm.unsqueeze(2)).view(-1)
        return logp, ent

    return run


def supports_fused(head: nn.Module, softcap: float | None = None) -> bool:
    """True for a plain `nn.Linear` head without logit soft-capping (the custom autograd paths)."""
    return type(head) is nn.Linear and type(head.weight.data) is torch.Tensor and not softcap


def _check(temperature: float, chunk_size: int | None, head_impl: str = "auto") -> float:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (or None: by kernel), got {chunk_size}")
    if head_impl not in HEAD_IMPLS:
        raise ValueError(f"head_impl={head_impl!r} is invalid; expected one of {HEAD_IMPLS}")
    return 1.0 / float(temperature)


def logprobs_from_hidden(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, *,
                         temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE,
                         softcap: float | None = None, upcast: bool = False, fused: bool | None = None,
                         head_impl: str = "auto"):
    """Chunked log-prob and entropy of `targets` given the hidden states that predict them.

    hidden (N, H), targets (N,) -> (logp (N,) float32, entropy (N,) float32 detached).
    `upcast` runs the head's matmul in float32 (plain Linear heads only; logits
    and the log-softmax are always float32). `fused=None` picks the custom
    autograd path for a plain `nn.Linear` head, checkpointed chunks otherwise.
    head_impl: the chunk kernel of the custom path, "auto" | "cpu" | "gpu" | "triton" (module docstring).
    chunk_size None: by kernel (512 tokens on cpu, GPU_CHUNK_BYTES of logits on gpu).
    """
    inv_temp = _check(temperature, chunk_size, head_impl)
    grad = torch.is_grad_enabled()
    if fused is None:
        fused = supports_fused(head, softcap)
    if fused:
        frozen = not head.weight.requires_grad and not (head.bias is not None and head.bias.requires_grad)
        jacobian = grad and hidden.requires_grad and frozen
        return _TwoPassHead.apply(hidden, head.weight, head.bias, targets, inv_temp, chunk_size, upcast, jacobian,
                                    head_impl)
    run = _generic_chunk(head, softcap, inv_temp)
    if chunk_size is None:
        chunk_size = CPU_CHUNK_SIZE
    outs = [checkpoint(run, hidden[sl], targets[sl], use_reentrant=False) if grad else run(hidden[sl], targets[sl])
            for sl in _chunks(hidden.shape[0], chunk_size)]
    if not outs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def fused_token_loss(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, token_loss, *,
                     temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE, upcast: bool = False,
                     head_impl: str = "auto"):
    """sum_i token_loss(logp, sl)_i with the backward work done chunk by chunk during the forward.

    hidden (N, H), targets (N,). `token_loss(logp (n,), sl)` returns the (n,)
    per-token loss of the tokens `sl` (a slice into 0..N); it may depend on
    logp only through elementwise ops, everything else it reads must be a
    constant (advantages, old / reference log-probs, weights). Returns
    (loss scalar with grad, logp (N,) detached, entropy (N,) detached).
    Needs a plain `nn.Linear` head (see `supports_fused`). head_impl: as `logprobs_from_hidden`.
    """
    inv_temp = _check(temperature, chunk_size, head_impl)
    if not supports_fused(head):
        raise ValueError(f"fused_token_loss needs a plain nn.Linear output head, got {type(head).__name__}")
    grad = torch.is_grad_enabled()
    bias = head.bias
    need = (grad and hidden.requires_grad, grad and head.weight.requires_grad,
            grad and bias is not None and bias.requires_grad)
    return _FusedTokenLoss.apply(hidden, head.weight, bias, targets, token_loss, inv_temp, chunk_size, upcast, need,
                                 head_impl)


def scatter_positions(values: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """Put N per-position values back into a (B, T) tensor aligned with input_ids.

    values (N,), select (B, T-1) bool (position t+1 predicted from t) -> (B, T), zeros elsewhere.
    """
    B = select.shape[0]
    body = torch.zeros(select.shape, dtype=values.dtype, device=values.device).masked_scatter(select, values)
    return torch.cat([body.new_zeros(B, 1), body], dim=1)


def logprobs_at(hidden: torch.Tensor, model, input_ids: torch.Tensor, positions: torch.Tensor, *,
                temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE, upcast: bool = False,
                fused: bool | None = None, head_impl: str = "auto",
                index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) log-probs and entropy of input_ids from hidden (B, T, H), only where `positions` (B, T) is set.

    Column 0 and unset positions are 0. index: the (N,) long flat positions b * T + t that predict
    the set positions (`trainer.batch.trained_index(positions)`), found before the forward: the
    tokens are then gathered and scattered back without a host sync.
    """
    head_opts = dict(temperature=temperature, chunk_size=chunk_size, softcap=logit_softcap(model), upcast=upcast,
                     fused=fused, head_impl=head_impl)
    if index is not None:
        B, T = input_ids.shape
        h = hidden.reshape(B * T, -1).index_select(0, index)  # (N, H)
        y = input_ids.reshape(-1).index_select(0, index + 1)  # (N,)
        lp, ent = logprobs_from_hidden(h, output_head(model), y, **head_opts)
        return scatter_index(lp, index + 1, (B, T)), scatter_index(ent, index + 1, (B, T))
    select = positions[:, 1:].bool()  # (B, T-1): token t+1 ...
    h = hidden[:, :-1][select]  # (N, H) ... is predicted from position t
    y = input_ids[:, 1:][select]  # (N,)
    lp, ent = logprobs_from_hidden(h, output_head(model), y, **head_opts)
    return scatter_positions(lp, select), scatter_positions(ent, select)


def scatter_index(values: torch.Tensor, index: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """values (N,) put at the flat positions `index` (N,) of a (B, T) tensor of zeros (no host sync)."""
    flat = torch.zeros(shape[0] * shape[1], dtype=values.dtype, device=values.device)
    return flat.index_put((index,), values).view(shape)


def token_logprobs(model, batch, temperature: float = 1.0, chunk_size: int | None = DEFAULT_CHUNK_SIZE,
                   return_entropy: bool = False, *, positions: torch.Tensor | None = None,
                   return_hidden: bool = False, upcast: bool = False, fused: bool | None = None,
                   share_prefix: bool = False, head_impl: str = "auto"):
    """Per-token log-probs of `batch.input_ids` under `model` at `temperature`, (B, T).

    batch: a `Batch` (or anything with `input_ids` and `attention_mask`).
    positions: (B, T) 0/1, which tokens to score (default: attention_mask;
    pass `loss_mask` to skip prompts entirely). Unscored positions and column 0 are 0.
    Returns the (B, T) tensor, or a `TokenLogProbs(logprobs, entropy, hidden_states)`
    when `return_entropy` or `return_hidden` is set (the hidden states come from
    the same forward, e.g. for a value head). share_prefix: rows with the same tokens
    before their first scored position run those tokens once (`final_hidden_states`'s
    `start`); hidden states before that position are then 0. head_impl: the chunk
    kernel, "auto" | "cpu" | "gpu" | "triton" (module docstring).
    """
    _check(temperature, chunk_size, head_impl)
    input_ids, attention_mask = batch.input_ids, batch.attention_mask
    if positions is None:
        positions = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    if positions.shape != input_ids.shape:
        raise ValueError(f"positions has shape {tuple(positions.shape)}, input_ids {tuple(input_ids.shape)}")
    start = first_positions(positions) if share_prefix else None
    hidden = final_hidden_states(model, input_ids, attention_mask, start=start)  # (B, T, H)
    logp, ent = logprobs_at(hidden, model, input_ids, positions, temperature=temperature,
                            chunk_size=chunk_size, upcast=upcast, fused=fused, head_impl=head_impl)
    if not (return_entropy or return_hidden):
        return logp
    return TokenLogProbs(logp, ent if return_entropy else None, hidden if return_hidden else None)
