"""How a decode step picks each row's token and its log-prob, with no host sync: `TokenPicker`, shared by
both HF decode loops (inverse-CDF sampling, one uniform per row and step from `row_uniforms`).

Legend: B rows, V vocab.
"""

from __future__ import annotations

import torch

from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.model.scoring.truncation import keep_threshold, kept_probs, row_truncation

BLOCK = 1024  # vocabulary entries per first-level block of the inverse CDF
M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), in two 16-bit halves of c (no int64 overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**32) with full avalanche (Wellons' "lowbias32"), on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_uniforms(keys: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """keys (B,) int64 >= 0, step (1,) int64 -> (B, 1) float64 uniforms in [0, 1) with 53 random bits: each a
    hash of its row's key and the step only (counter-based, device-independent, no host sync)."""
    lo, hi = keys & M32, (keys >> 32) & M32  # (B,)
    t = _mix32((step * 2 + 1) & M32)  # (1,)
    h1 = _mix32(_mix32(lo ^ t) ^ hi)  # (B,)
    h2 = _mix32(_mix32(hi ^ _mix32(t ^ 0x9E3779B9)) ^ lo ^ h1)  # (B,)
    return ((h1 << 21) + (h2 >> 11)).double().mul_(2.0**-53)[:, None]


def row_keys(seeds: list[int], n: int) -> list[int]:
    """The key of each row of a call (prompt-major: row i * n + j is prompt i's j-th sample): a mix of its
    prompt's seed and its sample index, in [0, 2**63)."""
    return [(s + j * 0x9E3779B97F4A7C15) % 2**63 for s in seeds for j in range(n)]


def inverse_cdf_sample(p: torch.Tensor, check: bool = True,
                       u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalized probabilities p (B, V) >= 0 -> ids (B,) with P(v) = p_v / sum(p), and sum(p) (B,) float64.

    One uniform per row: `u` (B, 1) float64 in [0, 1) (`row_uniforms`), else torch's global RNG. Float64
    cumsums; above 4 x BLOCK entries one over per-block sums picks a block, then one inside it the entry (no
    (B, V) temporary). An entry with p = 0 is never picked (the target stays strictly below the total).
    `check`: raise on a row with no finite positive mass (a host sync); else the caller checks the totals.
    """
    B, V = p.shape
    if u is None:
        u = torch.rand(B, 1, dtype=torch.float64, device=p.device)  # (B, 1)
    if V <= 4 * BLOCK:
        cum = p.double().cumsum(-1)  # (B, V)
        total = checked_mass(cum[:, -1:], check)  # (B, 1)
        target = torch.minimum(u * total, total * (1 - 1e-12))
        return torch.searchsorted(cum, target, right=True).clamp_(max=V - 1).squeeze(1), total.squeeze(1)
    nb, rem = divmod(V, BLOCK)
    parts = [p[:, : nb * BLOCK].view(B, nb, BLOCK).sum(-1)] + ([p[:, nb * BLOCK:].sum(-1, keepdim=True)] if rem else [])
    blk = torch.cat(parts, dim=1).double()  # (B, blocks)
    cum = blk.cumsum(-1)  # (B, blocks)
    total = checked_mass(cum[:, -1:], check)  # (B, 1)
    target = torch.minimum(u * total, total * (1 - 1e-12))
    j = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[1] - 1)  # (B, 1) block
    before = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # (B, blocks) mass of the blocks before each one
    r = target - before.gather(1, j)  # (B, 1) >= 0: cum[j - 1] <= target < cum[j]
    idx = j * BLOCK + torch.arange(BLOCK, device=p.device)  # (B, BLOCK)
    inner = p.gather(1, idx.clamp(max=V - 1)).double().masked_fill_(idx >= V, 0.0).cumsum(-1)  # (B, BLOCK)
    r = torch.minimum(r, inner[:, -1:] * (1 - 1e-12))  # float32 block sums vs float64 inner sums
    k = torch.searchsorted(inner, r, right=True).clamp_(max=BLOCK - 1)  # (B, 1)
    return (j * BLOCK + k).squeeze(1), total.squeeze(1)


def unsampleable(total: torch.Tensor) -> torch.Tensor:
    """Rows whose probability mass `total` (B,) or (B, 1) is NaN, inf or 0: bool, same shape."""
    return ~(torch.isfinite(total) & (total > 0))


def mass_error(bad: torch.Tensor) -> ValueError | None:
    """The error for the rows marked in `bad` (B,) bool, None when there are none (a host sync)."""
    if not bool(bad.any()):
        return None
    rows = bad.flatten().nonzero().flatten().tolist()
    return ValueError(f"cannot sample: the scores of {len(rows)} of {bad.numel()} rows are NaN/inf or "
                      f"mask out every token (first rows: {rows[:8]})")


def checked_mass(total: torch.Tensor, check: bool) -> torch.Tensor:
    """`total` as given; with `check`, the `mass_error` of its rows raised first (a host sync)."""
    error = mass_error(unsampleable(total)) if check else None
    if error is not None:
        raise error
    return total


class TokenPicker:
    """One decode step's choice from the (B, V) float32 scores, with no host sync: `pick(scores) -> (ids (B,),
    logprobs (B,), mass (B,) float64 or None)`: the chosen token's log_softmax(raw scores / T) (the truncated
    distribution's where `SamplingConfig.records_truncated`), and the sampled total, for `unsampleable`."""

    def __init__(self, cfg: SamplingConfig):
        self.greedy, self.inv_t = cfg.greedy, 1.0 / cfg.logprob_temperature
        self.truncates = cfg.truncates and not cfg.greedy
        self.records_truncated = cfg.records_truncated
        self.settings = (int(cfg.top_k or 0), 1.0 if cfg.top_p is None else float(cfg.top_p), float(cfg.min_p or 0))
        self._trunc = None  # the (B,) Truncation of the decode's rows, built on the first step
        self._buf: torch.Tensor | None = None  # (B, V) float32, reused by every step of a decode
        self.shift = LogitShift(cfg) if cfg.shifts_logits else None
        self.keys: torch.Tensor | None = None  # (B,) int64 row keys (`start`); None: torch's global RNG
        self.step: torch.Tensor | None = None  # (1,) int64 steps picked since `start`

    def _scratch(self, x: torch.Tensor) -> torch.Tensor:
        if self._buf is None or self._buf.shape != x.shape:
            self._buf = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return self._buf

    def start(self, keys: list[int], device) -> None:
        """A new decode whose row i draws from the stream of keys[i] (`row_keys`): copied into the picker's
        buffers in place (a captured CUDA graph keeps reading them), the step set to 0."""
        new = torch.tensor(keys, dtype=torch.long, device=device)  # (B,)
        if self.keys is None or self.keys.shape != new.shape or self.keys.device != new.device:
            self.keys, self.step = new, torch.zeros(1, dtype=torch.long, device=device)
        else:
            self.keys.copy_(new)
            self.step.zero_()

    def _uniforms(self, B: int) -> torch.Tensor | None:
        """(B, 1) float64: this step's uniform per row (`row_uniforms`), the step counted; None without keys."""
        if self.keys is None:
            return None
        if self.keys.shape[0] != B:
            raise ValueError(f"the picker was started for {self.keys.shape[0]} rows, got scores of {B}")
        u = row_uniforms(self.keys, self.step)
        self.step.add_(1)
        return u

    def prepare(self, scores: torch.Tensor) -> None:
        """Before a decode (and before any CUDA graph capture): the step buffers for scores' (B, V) shape,
        the penalty counts of a new completion zeroed in place."""
        self._scratch(scores)
        if self.truncates:
            self._rows(scores)
        if self.shift is not None:
            self.shift.reset(scores)

    def pick(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.shift is not None:
            return self._pick_shifted(scores)
        inv_t = self.inv_t
        m = scores.amax(-1, keepdim=True)  # (B, 1)
        d = torch.sub(scores, m, out=self._scratch(scores))  # (B, V)
        if inv_t != 1.0:
            d.mul_(inv_t)
        if self.greedy:
            tok = scores.argmax(-1, keepdim=True)  # (B, 1)
            lse = m * inv_t + d.exp_().sum(-1, keepdim=True).log()
            return tok.squeeze(1), (scores.gather(1, tok) * inv_t - lse).squeeze(1), None
        u = self._uniforms(scores.shape[0])
        if not self.truncates:  # one exp pass serves the sampling and the log-sum-exp
            tok, total = inverse_cdf_sample(d.exp_(), check=False, u=u)
            lse = m * inv_t + total[:, None].log().float()
        else:
            full_lse = None if self.records_truncated else m * inv_t + d.exp_().sum(-1, keepdim=True).log()  # (B, 1)
            z = scores * inv_t  # (B, V) tempered, as the trainer's heads compute them
            p = kept_probs(z, keep_threshold(z, self._rows(z)), out=self._scratch(z))  # (B, V)
            tok, total = inverse_cdf_sample(p, check=False, u=u)
            kept_lse = z.amax(-1, keepdim=True) + total[:, None].log().float()  # (B, 1) over the kept set
            if self.records_truncated:
                tok = tok[:, None]
                return tok.squeeze(1), (z.gather(1, tok) - kept_lse).squeeze(1), total
            lse = full_lse
        tok = tok[:, None]  # (B, 1)
        return tok.squeeze(1), (scores.gather(1, tok) * inv_t - lse).squeeze(1), total

    def _rows(self, scores: torch.Tensor):
        """The (B,) `Truncation` of this decode's rows (one setting for all), kept across steps (graph-safe)."""
        B = scores.shape[0]
        if self._trunc is None or self._trunc.top_k.shape[0] != B or self._trunc.top_k.device != scores.device:
            self._trunc = row_truncation(B, *self.settings, scores.device)
        return self._trunc

    def _pick_shifted(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`pick` with logit_bias / penalties: the draw is from the shifted scores, the log-prob of the raw ones."""
        inv_t, buf = self.inv_t, self._scratch(scores)
        m = scores.amax(-1, keepdim=True)  # (B, 1)
        d = torch.sub(scores, m, out=buf)  # (B, V)
        if inv_t != 1.0:
            d.mul_(inv_t)
        lse = m * inv_t + d.exp_().sum(-1, keepdim=True).log()  # (B, 1) of the raw scores at T
        z = self.shift.apply(scores, out=buf)  # (B, V) the scores the draw is made from
        total = None
        if self.greedy:
            tok = z.argmax(-1, keepdim=True)  # (B, 1)
        else:
            if self.truncates:  # the kept set of the shifted scores (log-probs stay of the raw ones)
                z = z * inv_t
                p = kept_probs(z, keep_threshold(z, self._rows(z)), out=buf)  # (B, V)
            else:
                p = z.sub_(z.amax(-1, keepdim=True))
                p = (p.mul_(inv_t) if inv_t != 1.0 else p).exp_()  # (B, V)
            tok, total = inverse_cdf_sample(p, check=False, u=self._uniforms(scores.shape[0]))
            tok = tok[:, None]  # (B, 1)
        self.shift.count(tok)
        return tok.squeeze(1), (scores.gather(1, tok) * inv_t - lse).squeeze(1), total


class LogitShift:
    """What logit_bias and the frequency / presence penalties add to a decode step's raw scores: one (B, V)
    float32 `offset` (bias minus the penalties of the ids picked so far in this completion), set per
    completion by `reset` and updated in place by `count` after each pick: graph-safe (docs/generation.md)."""

    def __init__(self, cfg: SamplingConfig):
        self.pairs, self.freq, self.pres = cfg.logit_bias, cfg.frequency_penalty, cfg.presence_penalty
        self.bias: torch.Tensor | None = None  # (V,) float32
        self.offset: torch.Tensor | None = None  # (B, V) float32
        self.counts: torch.Tensor | None = None  # (B, V) float32, only with penalties
        self.ones: torch.Tensor | None = None  # (B, 1) float32

    def reset(self, scores: torch.Tensor) -> None:
        B, V = scores.shape
        dev = scores.device
        if self.offset is None or self.offset.shape != scores.shape or self.offset.device != dev:
            self.offset = torch.zeros(B, V, dtype=torch.float32, device=dev)
            self.ones = torch.ones(B, 1, dtype=torch.float32, device=dev)
            self.counts = torch.zeros(B, V, dtype=torch.float32, device=dev) if self.freq or self.pres else None
        if self.pairs and (self.bias is None or self.bias.shape[0] != V or self.bias.device != dev):
            bad = [t for t, _ in self.pairs if t >= V]
            if bad:
                raise ValueError(f"logit_bias names token id {bad[0]}, outside the model's {V} scored ids [0, {V})")
            ids, values = zip(*self.pairs, strict=True)
            self.bias = torch.zeros(V, dtype=torch.float32, device=dev)
            self.bias[torch.tensor(ids, device=dev)] = torch.tensor(values, dtype=torch.float32, device=dev)
        if self.bias is not None:
            self.offset.copy_(self.bias.expand(B, V))
        else:
            self.offset.zero_()
        if self.counts is not None:
            self.counts.zero_()

    def apply(self, scores: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """scores (B, V) + offset into `out` (allocated on the first call of a completion: `reset`)."""
        if self.offset is None or self.offset.shape != scores.shape or self.offset.device != scores.device:
            self.reset(scores)
        return torch.add(scores, self.offset, out=out)

    def count(self, tok: torch.Tensor) -> None:
        """After a pick of tok (B, 1): its count + 1, its offset - (frequency + presence if it is new)."""
        if self.counts is None:
            return
        step = (self.counts.gather(1, tok) == 0).float().mul_(self.pres).add_(self.freq)  # (B, 1)
        self.counts.scatter_add_(1, tok, self.ones)
        self.offset.scatter_add_(1, tok, step.neg_())
