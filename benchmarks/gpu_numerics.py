"""The head's kernels against float64 on a model's own hidden states: the full softmax and the truncated path.

Legend: n scored tokens, H hidden size, V vocab.

`gpu_check.py`'s profile part runs `head_numerics` on CUDA ("cpu", "gpu", "triton": the truncated path is
the one the trainer takes for turns sampled with top-k / top-p / min-p); on CPU with --smoke.
"""

from __future__ import annotations


def head_numerics(model, tb, n: int = 512, impls=("cpu", "gpu")) -> dict:
    """Each kernel against float64 on the model's own hidden states (n trained tokens): max |d logp|, max
    |d entropy| and the max error of d logp / d h relative to its largest entry; and the same under top-k 50 /
    top-p 0.9's kept set (`<impl>_truncated`: the truncated path, "triton" on CUDA)."""
    import torch

    from SimpleTorchLLMRL.model.scoring.head import final_hidden_states, output_head
    from SimpleTorchLLMRL.model.scoring.truncation import row_truncation

    head = output_head(model)
    with torch.no_grad():
        hidden = final_hidden_states(model, tb.batch.input_ids, tb.batch.attention_mask)
    select = tb.mask[:, 1:].bool()
    h, y = hidden[:, :-1][select][:n].detach(), tb.batch.input_ids[:, 1:][select][:n]
    h64 = h.double().requires_grad_()
    lp_all = torch.log_softmax(h64 @ head.weight.double().T, -1)
    lp64 = lp_all.gather(1, y[:, None]).squeeze(1)
    ent64 = -(lp_all.exp() * lp_all).sum(-1)
    lp64.sum().backward()
    out = {"tokens": int(h.shape[0])}
    for impl in impls:
        out[impl] = _kernel_against(h, head, y, impl, None, (lp64, ent64, h64.grad))
    trunc = row_truncation(h.shape[0], 50, 0.9, 0.0, h.device)  # top-k 50 and top-p 0.9, as sampled
    ref = _truncated_float64(h, head, y, trunc)
    for impl in impls:
        out[f"{impl}_truncated"] = _kernel_against(h, head, y, impl, trunc, ref)
    return out


def _truncated_float64(h, head, y, trunc):
    """float64 log p, entropy and d logp / d h of the tokens `y` under the kept set of `trunc`."""
    import torch

    from SimpleTorchLLMRL.model.scoring.truncation import apply_cut, keep_threshold

    h64 = h.double().requires_grad_()
    z = h64 @ head.weight.double().T
    lp_all = torch.log_softmax(apply_cut(z, keep_threshold(z, trunc, y)), -1)
    lp64 = lp_all.gather(1, y[:, None]).squeeze(1)
    lp64.sum().backward()
    return lp64.detach(), -(lp_all.exp() * lp_all).sum(-1).detach(), h64.grad


def _kernel_against(h, head, y, impl: str, trunc, ref) -> dict:
    """One kernel's log-probs, entropy and gradient against float64's `ref` (max abs, max relative gradient)."""
    from SimpleTorchLLMRL.model.scoring.logprobs import logprobs_from_hidden

    lp64, ent64, grad64 = ref
    hh = h.clone().requires_grad_()
    try:
        lp, ent = logprobs_from_hidden(hh, head, y, head_impl=impl, truncation=trunc)
        lp.sum().backward()
    except Exception as e:  # noqa: BLE001  (recorded: a kernel that fails here is reported, not fatal)
        return {"error": f"{type(e).__name__}: {e}"[-2000:]}
    return {"logp_max_abs": float((lp.double() - lp64).abs().max()),
            "entropy_max_abs": float((ent.double() - ent64).abs().max()),
            "grad_h_max_rel": float((hh.grad.double() - grad64).abs().max() / grad64.abs().max())}
