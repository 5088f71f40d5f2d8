"""The kept set of top-k / top-p / min-p sampling, shared by the sampler's picker and the trainer's heads.

Legend: n rows (decode rows or scored tokens), V vocab, K the widest top-k.

Every one of the three keeps a TOP set of the tempered logits z = logits / T, so what they keep
together is {v : z_v >= cut} for one per-row threshold `cut` (`keep_threshold`). They apply in
vLLM's order: min-p, then top-k, then top-p on what those two kept, renormalized:

- min-p: keep p_v >= min_p * max_u p_u, i.e. z_v >= max(z) + log(min_p);
- top-k: keep z_v >= the k-th largest z (every token tied with the k-th is kept, as HF's
  `TopKLogitsWarper` and vLLM do);
- top-p: keep v when the mass of the tokens ranked strictly above it is < top_p (the smallest top
  set whose mass reaches top_p, as HF and vLLM); tokens tied with a kept one are kept too, where
  HF and vLLM break such a tie by their sort's order.

The sampler (`model/generation/picker.py`) draws from exactly this set and records log p_trunc(y) =
z_y - logsumexp over the kept set; the heads (`model/scoring/head_kernels.py`, `model/scoring/head_triton.py`,
the checkpointed generic head) score with the same function, so the two agree up to the logits'
own rounding. Scoring also keeps the scored token itself (`cut <= z_y`): logits recomputed in
another kernel may place a sampled token a rounding error below its cut, which would otherwise
be log 0. Per-token settings come as a `chat.truncation.Truncation` (its host-side plan picks
the ops, so nothing here waits for the device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from SimpleTorchLLMRL.chat.truncation import Truncation

FLOOR = 1.0e4  # a cut-off logit is set this far below the cut: exp underflows to 0, products stay finite


def keep_threshold(z: torch.Tensor, t: Truncation, y: torch.Tensor | None = None) -> torch.Tensor:
    """cut (n,) float32: row i keeps {v : z[i, v] >= cut[i]} (-inf: keeps everything).

    z (n, V) float32 tempered logits; t (n,) settings; y (n,) long: the scored tokens, always kept.
    """
    z = z.detach()
    n, V = z.shape
    zmax = z.amax(-1)  # (n,)
    cut = torch.full((n,), float("-inf"), dtype=z.dtype, device=z.device)
    if t.any_min_p:
        log_min_p = t.min_p.to(z.dtype).clamp(min=1e-30).log()
        cut = torch.where(t.min_p > 0, zmax + log_min_p, cut)
    vals = None
    if t.max_k:
        K = min(t.max_k, V)
        vals = z.topk(K, dim=-1).values  # (n, K) descending
        kth = vals.gather(1, (t.top_k.clamp(1, K) - 1)[:, None]).squeeze(1)  # (n,)
        cut = torch.where(t.top_k > 0, torch.maximum(cut, kth), cut)
    if t.any_top_p:
        s = z.sort(dim=-1, descending=True).values if t.full_sort or vals is None else vals  # (n, M) descending
        e = torch.exp(s - zmax[:, None]).masked_fill_(s < cut[:, None], 0.0)  # (n, M) unnormalized kept mass
        total = torch.exp(z - zmax[:, None]).masked_fill_(z < cut[:, None], 0.0).sum(-1)  # (n,) whole row
        above = F.pad(e.cumsum(-1)[:, :-1], (1, 0))  # (n, M) mass ranked strictly above each entry
        kept = (above < t.top_p.to(z.dtype)[:, None] * total[:, None]) & (s >= cut[:, None])
        cut_p = s.masked_fill(~kept, float("inf")).amin(-1)  # (n,) the smallest kept value (entry 0 always is)
        cut = torch.where(t.top_p < 1, torch.maximum(cut, cut_p), cut)
    if y is not None:
        cut = torch.minimum(cut, z.gather(1, y[:, None]).squeeze(1))
    return cut


def apply_cut(z: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """z (n, V) with the entries below cut (n,) moved FLOOR under the cut: softmax gives them exactly 0,
    log-softmax stays finite (so p * log p terms are 0, not NaN). A new tensor; gradients flow to kept entries."""
    low = (cut - FLOOR)[:, None]  # (n, 1); -inf where nothing is cut (then no entry is below the cut)
    return torch.where(z >= cut[:, None], z, low.to(z.dtype))


def kept_probs(z: torch.Tensor, cut: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Unnormalized sampling weights (n, V) float32: exp(z - max z) on the kept set, 0 elsewhere."""
    p = torch.sub(z, z.amax(-1, keepdim=True), out=out).exp_()
    return p.masked_fill_(z < cut[:, None], 0.0)


def row_truncation(n: int, top_k: int, top_p: float, min_p: float, device) -> Truncation:
    """One setting for every one of n rows (the picker's: a decode call has one SamplingConfig)."""
    return Truncation(torch.full((n,), int(top_k), dtype=torch.long, device=device),
                      torch.full((n,), float(top_p), dtype=torch.float32, device=device),
                      torch.full((n,), float(min_p), dtype=torch.float32, device=device),
                      max_k=int(top_k), full_sort=top_p < 1 and not top_k, any_top_p=top_p < 1, any_min_p=min_p > 0)
