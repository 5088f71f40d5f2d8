"""The output head's chunk kernels: one chunk of tokens scored, and its gradient formed.

Legend: N tokens, n of a chunk, H hidden size, V vocab.

A chunk kernel answers three questions about a chunk of n tokens (hc (n, H), yc (n,)):
`score` (log p(y), entropy, logsumexp; pass 1), `grad_logits` (dL/dz from the per-token
dL/dlogp and dL/dentropy, the logits recomputed; pass 2) and `accumulate` (dL/dz into the
hidden-state, weight and bias gradients). Three kernels, chosen by `head_impl` in
`scoring.logprobs` (its docstring says which runs where):

- `_LinearChunks` ("cpu"): row blocks whose float32 scratch stays under glibc's mmap threshold;
- `_DeviceChunks` ("gpu"): whole-chunk ops, GEMMs in the head's dtype with float32 accumulation;
- `_TritonChunks` ("triton"): the "gpu" GEMMs, the elementwise passes in `head_triton`.

Two autograd functions run them over all N tokens: `_TwoPassHead` (statistics without autograd,
the loss once on them, logits recomputed in backward) and `_FusedTokenLoss` (the gradient formed
chunk by chunk in the forward from a per-token loss closure). `scoring.logprobs` picks the kernel
class and the chunk size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from SimpleTorchLLMRL.model.scoring import head_triton
from SimpleTorchLLMRL.model.scoring.truncation import apply_cut, keep_threshold

SCRATCH_BYTES = 16 * 2**20  # row blocks for the softmax sums inside a chunk stay under glibc's mmap threshold


def _chunks(n: int, size: int):
    return [slice(s, s + size) for s in range(0, n, size)]


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
        self.grad_h = torch.zeros_like(like) if need_h else None  # (N, H)
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

    def score(self, hc: torch.Tensor, yc: torch.Tensor, probs: bool, entropy: bool, trunc=None):
        """hc (n, H), yc (n,) -> logp (n,), entropy (n,) | None, logsumexp (n,), softmax p (n, V) | None,
        cut (n,) | None.

        trunc: the chunk's (n,) `Truncation` (None: the full softmax). With it every statistic is of the
        truncated, renormalized distribution, whose kept set is {z >= cut} (`scoring/truncation.py`).
        The row blocks leave exp(z - m) in the logits buffer, so p is one multiply by 1 / S.
        The row-wise sums use one (rows, V) scratch of <= SCRATCH_BYTES: fresh blocks
        over 32 MiB are mmapped by glibc and page-faulted on every allocation.
        """
        z, cut = self._cut_logits(hc, yc, trunc)  # (n, V), (n,) | None
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
        return logit_y - lse, ent, lse, p, cut

    def _cut_logits(self, hc: torch.Tensor, yc: torch.Tensor, trunc):
        """The chunk's tempered logits (n, V), those below the kept set's cut moved out of it; cut (n,) | None."""
        z = self._logits(hc)
        if trunc is None:
            return z, None
        cut = keep_threshold(z, trunc, yc)
        return apply_cut(z, cut), cut

    def grad_logits(self, hc, yc, lse, ent, c_lp, c_ent, cut=None) -> torch.Tensor:
        """Pass 2: dL/dz (n, V) of the chunk's raw logits, recomputed from hc and pass 1's lse / entropy (n,).

        c_lp (n,) = dL/dlogp, c_ent (n,) | None = dL/dentropy. With p = softmax and
        log p = z / T - lse: dL/dz = (c_lp (onehot(y) - p) - c_ent p (log p + H)) / T.
        cut (n,) | None: pass 1's kept-set threshold (p is then 0 outside the kept set).
        """
        z = self._logits(hc)
        logsm = (z if cut is None else apply_cut(z, cut)).sub_(lse[:, None])  # (n, V) log-softmax
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

    def score(self, hc: torch.Tensor, yc: torch.Tensor, probs: bool, entropy: bool, trunc=None):
        z, cut = self._cut_logits(hc, yc, trunc)  # (n, V) float32
        logit_y = z.gather(1, yc[:, None]).squeeze(1)  # (n,)
        lse = torch.logsumexp(z, dim=-1)  # (n,)
        logsm = z.sub_(lse[:, None])  # (n, V) log-softmax, in place
        p = logsm.exp() if (probs or entropy) else None  # (n, V)
        ent = -torch.linalg.vecdot(p, logsm) if entropy else None  # (n,)
        return logit_y - lse, ent, lse, p, cut

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

    def score(self, hc: torch.Tensor, yc: torch.Tensor, probs: bool, entropy: bool, trunc=None):
        z = self.logits(hc)  # (n, V) float32; row_stats applies the temperature
        cut = None if trunc is None else keep_threshold(z * self.inv_temp, trunc, yc)  # (n,) tempered units
        logp, ent, lse = head_triton.row_stats(z, yc, self.inv_temp, cut=cut)
        return logp, ent if entropy else None, lse, (z, lse, cut) if probs else None, cut

    def _grad_buffer(self, z: torch.Tensor) -> torch.Tensor:
        if self._g is None or self._g.shape[0] < z.shape[0]:
            self._g = torch.empty(z.shape, dtype=self.W.dtype, device=z.device)
        return self._g[: z.shape[0]]

    def dlogp_dlogits(self, p, yc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        z, lse, cut = p
        return head_triton.row_grad(z, yc, lse, scale * self.inv_temp, self.inv_temp, out=self._grad_buffer(z),
                                    cut=cut)

    def grad_logits(self, hc, yc, lse, ent, c_lp, c_ent, cut=None) -> torch.Tensor:
        z = self.logits(hc)  # (n, V) float32, temperature applied inside the kernel
        ent, c_ent = (None, None) if c_ent is None else (ent, c_ent * self.inv_temp)
        return head_triton.row_grad(z, yc, lse, c_lp * self.inv_temp, self.inv_temp, out=self._grad_buffer(z),
                                    ent=ent, c_ent=c_ent, cut=cut)

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


# ---------------------------------------------------------------- the autograd paths over the kernels


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
    def forward(ctx, h, weight, bias, y, inv_temp, chunk_size, upcast, jacobian, kernel, trunc=None):
        # h (N, H), weight (V, H), bias (V,) | None, y (N,); kernel: a chunk kernel class, chunk_size: its tokens;
        # trunc: (N,) `Truncation` | None (scores under the truncated distribution the sampler drew from)
        head = kernel(weight, bias, inv_temp, upcast, need=(jacobian, False, False), like=h.float())
        logp, ent, lse, cuts = [], [], [], []
        for sl in _chunks(h.shape[0], chunk_size):
            hc, yc = h[sl], y[sl]
            lp_c, ent_c, lse_c, p, cut_c = head.score(hc, yc, probs=jacobian, entropy=True, trunc=_rows(trunc, sl))
            if jacobian:
                head.accumulate(head.dlogp_dlogits(p, yc, torch.ones_like(lp_c)), hc, sl)
            del p
            logp.append(lp_c), ent.append(ent_c), lse.append(lse_c), cuts.append(cut_c)
        logp, ent, lse = (_cat(t, h) for t in (logp, ent, lse))  # (N,) float32 each
        cut = _cat(cuts, h) if trunc is not None else None  # (N,) the kept sets' thresholds, for pass 2
        head.free_buffers()
        ctx.save_for_backward(h, weight, bias, y, lse, ent, head.grad_h, cut)
        ctx.inv_temp, ctx.chunk_size, ctx.upcast, ctx.kernel = inv_temp, chunk_size, upcast, kernel
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        h, weight, bias, y, lse, ent, jac, cut = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3])
        nones = (None,) * 7
        if grad_logp is None and grad_ent is None:
            return None, None, None, *nones
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if jac is not None and grad_ent is None and not (need[1] or need[2]):
            return (grad_logp[:, None] * jac).to(h.dtype), None, None, *nones
        head = ctx.kernel(weight, bias, ctx.inv_temp, ctx.upcast, need=need, like=h)
        c_lp, c_ent = grad_logp.float(), None if grad_ent is None else grad_ent.float()
        for sl in _chunks(h.shape[0], ctx.chunk_size):
            g = head.grad_logits(h[sl], y[sl], lse[sl], ent[sl], c_lp[sl], None if c_ent is None else c_ent[sl],
                                 None if cut is None else cut[sl])
            head.accumulate(g, h[sl], sl)
        return *head.grads(weight, bias), None, *nones[:6]


def _rows(trunc, sl: slice):
    """The chunk `sl` of an (N,) `Truncation`, None without one."""
    return None if trunc is None else trunc.map(lambda t: t[sl])


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
    def forward(ctx, h, weight, bias, y, token_loss, inv_temp, chunk_size, upcast, need, kernel, trunc=None):
        head = kernel(weight, bias, inv_temp, upcast, need=need, like=h)
        logp, ent, losses = [], [], []
        for sl in _chunks(h.shape[0], chunk_size):
            hc, yc = h[sl], y[sl]
            lp, ent_c, _, p, _ = head.score(hc, yc, probs=True, entropy=True, trunc=_rows(trunc, sl))
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
        return *grads, None, None, None, None, None, None, None, None
