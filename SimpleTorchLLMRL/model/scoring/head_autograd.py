"""The two autograd paths of the output head, over the chunk kernels of `head_kernels`.

Legend: N tokens, n of a chunk, H hidden size, V vocab.

`_TwoPassHead` (statistics without autograd, the loss once on them, logits recomputed in
backward) and `_FusedTokenLoss` (the gradient formed chunk by chunk in the forward from a
per-token loss closure). `scoring.logprobs` picks the kernel class and the chunk size.
"""

from __future__ import annotations

import torch

from SimpleTorchLLMRL.model.scoring.head_kernels import _chunks


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
