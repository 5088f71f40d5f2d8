"""Which sampled tokens were drawn from a truncated distribution (top-k / top-p / min-p), per token.

Legend: B rollouts, T tokens, N scored tokens.

A turn whose `Message.sampling` records top_k, top_p or min_p (and nothing the trainer cannot replay) has
log-probs under that truncated distribution, and the trainer scores it under the same one (docs/generation.md).
`truncation_settings` is that one rule for sampler and trainer; the kept set's math is in
`model/scoring/truncation.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

# settings the trainer cannot replay: with any of them, a turn keeps the full-distribution convention
UNREPLAYABLE = ("logit_bias", "frequency_penalty", "presence_penalty", "grammar")


def truncation_settings(sampling: Mapping | None) -> tuple[int, float, float] | None:
    """(top_k, top_p, min_p) of a turn's `Message.sampling` (0 / 1.0 / 0.0: off), None when the turn's
    log-probs are of the full distribution: nothing truncated, or an unreplayable change (logit_bias,
    penalties, grammar) shaped the draw too. ValueError naming a malformed value."""
    if not sampling or any(sampling.get(k) for k in UNREPLAYABLE):
        return None
    top_k, top_p, min_p = sampling.get("top_k") or 0, sampling.get("top_p"), sampling.get("min_p") or 0.0
    top_p = 1.0 if top_p is None else top_p
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"sampling top_k must be an int >= 0, got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"sampling top_p must be a number in (0, 1], got {top_p!r}")
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p <= 1:
        raise ValueError(f"sampling min_p must be a number in [0, 1], got {min_p!r}")
    if not top_k and top_p >= 1 and not min_p:
        return None
    return int(top_k), float(top_p), float(min_p)


@dataclass(frozen=True)
class Truncation:
    """Per-token truncation settings, all tensors of one shape ((B, T) aligned with input_ids, or (N,)).

    top_k long (0: off), top_p float32 (1: off), min_p float32 (0: off); the setting at position t applies
    to the distribution that token t was drawn from. Host-side plan, so scoring never reads the device:
    max_k the largest top_k (0: none), full_sort whether some token has top_p < 1 without a top_k (its
    kept set needs the whole sorted row), any_top_p / any_min_p whether any token uses them.
    """

    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    max_k: int
    full_sort: bool
    any_top_p: bool
    any_min_p: bool

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Truncation:
        """The same plan over fn(each tensor) (a row slice, a device move, a gather of tokens)."""
        return Truncation(fn(self.top_k), fn(self.top_p), fn(self.min_p), self.max_k, self.full_sort,
                          self.any_top_p, self.any_min_p)

    def at(self, index: torch.Tensor) -> Truncation:
        """The (N,) settings of the flat positions `index` (N,) of a (B, T) one."""
        return self.map(lambda t: t.reshape(-1).index_select(0, index))



def batch_truncation(rollouts, message_index: torch.Tensor | None,
                     sampler_logprobs: torch.Tensor | None) -> Truncation | None:
    """The (B, T) `Truncation` of a collated batch's sampled tokens, None when no token was truncated.

    message_index (B, T) long, the message each token belongs to (-1: none); sampler_logprobs (B, T),
    NaN on tokens nobody sampled (those keep the full distribution: no sampler drew them).
    """
    per_row = [[truncation_settings(m.sampling) if m.logprobs is not None else None for m in r] for r in rollouts]
    if message_index is None or sampler_logprobs is None or not any(s for row in per_row for s in row):
        return None
    B, T = message_index.shape
    M = max(len(row) for row in per_row)
    table = torch.tensor([[s or (0, 1.0, 0.0) for s in row] + [(0, 1.0, 0.0)] * (M - len(row)) for row in per_row],
                         dtype=torch.float64)  # (B, M, 3)
    sampled = (message_index >= 0) & ~torch.isnan(sampler_logprobs)  # (B, T)
    idx = message_index.clamp(min=0)[:, :, None].expand(B, T, 3)
    values = table.gather(1, idx)  # (B, T, 3)
    off = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    values = torch.where(sampled[:, :, None], values, off)
    top_k, top_p, min_p = values.unbind(-1)
    top_k = top_k.long()
    used = [s for row in per_row for s in row if s]
    return Truncation(top_k, top_p.float(), min_p.float(), max_k=max(s[0] for s in used),
                      full_sort=any(s[1] < 1 and not s[0] for s in used), any_top_p=any(s[1] < 1 for s in used),
                      any_min_p=any(s[2] > 0 for s in used))
