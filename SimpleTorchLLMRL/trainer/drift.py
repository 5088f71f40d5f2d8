"""Log-prob drift between the generator and the trainer, attributed to messages, roles and agents.

Legend: B rollouts, T tokens.

With the same weights and temperature the sampled and recomputed log-probs agree up to numerics, so a gap
says something differs between sampling and training (backend, stale weights, a re-rendered context).
`logprob_drift` reports |d| = |recomputed - sampled| per message, role and agent: mean and max |d| and the
share of tokens whose ratio exp(d) lies outside [1 - band, 1 + band]; `report.worst()` names the turns to
look at. Usage: docs/masks_and_templates.md, "Which turn drifts?".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from SimpleTorchLLMRL.chat.message import Rollout
from SimpleTorchLLMRL.chat.tokenize import Batch


@dataclass
class DriftStats:
    """Drift over a set of tokens: count, mean and max |d|, share with exp(d) outside the band."""

    tokens: int
    mean_abs: float
    max_abs: float
    frac_outside: float


@dataclass
class MessageDrift(DriftStats):
    """Drift over one message's sampled tokens."""

    rollout: int = 0
    message: int = 0
    role: str = ""
    name: str | None = None


@dataclass
class DriftReport:
    overall: DriftStats
    by_role: dict[str, DriftStats]
    by_agent: dict[str, DriftStats]
    messages: list[MessageDrift]
    band: float

    def worst(self, k: int = 5) -> list[MessageDrift]:
        """The k messages with the largest mean |d|."""
        return sorted(self.messages, key=lambda m: m.mean_abs, reverse=True)[:k]

    def _groups(self):
        """Role and agent tables; the agent table only when some message has a name."""
        named = set(self.by_agent) - {"-"}
        return (("role", self.by_role),) + ((("agent", self.by_agent),) if named else ())

    def summary(self) -> dict[str, float]:
        """Flat numbers for a metrics logger: overall, per role, per agent, and the worst message."""
        out = {f"{k}": v for k, v in vars(self.overall).items()}
        for group, table in self._groups():
            for key, s in table.items():
                out[f"{group}/{key}/mean_abs"] = s.mean_abs
                out[f"{group}/{key}/frac_outside"] = s.frac_outside
        if self.messages:
            w = self.worst(1)[0]
            out.update(worst_mean_abs=w.mean_abs, worst_rollout=w.rollout, worst_message=w.message)
        return out

    def __str__(self) -> str:
        lines = [f"log-prob drift over {self.overall.tokens} sampled tokens: mean |d| {self.overall.mean_abs:.3g}, "
                 f"max {self.overall.max_abs:.3g}, {self.overall.frac_outside:.1%} outside "
                 f"[{1 - self.band:g}, {1 + self.band:g}]"]
        for group, table in self._groups():
            for key, s in table.items():
                lines.append(f"  {group} {key:12s} {s.tokens:6d} tokens  mean |d| {s.mean_abs:.3g}  "
                             f"max {s.max_abs:.3g}  outside {s.frac_outside:.1%}")
        for m in self.worst():
            who = m.role + (f" {m.name}" if m.name else "")
            lines.append(f"  worst: rollout {m.rollout} message {m.message} ({who}) {m.tokens} tokens  "
                         f"mean |d| {m.mean_abs:.3g}  max {m.max_abs:.3g}")
        return "\n".join(lines)


def _stats(n: int, total: float, peak: float, outside: int) -> DriftStats:
    return DriftStats(n, total / n if n else float("nan"), peak, outside / n if n else float("nan"))


def _gaps(rollouts, parts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rollout, message, d) for every token with a sampled and a recomputed log-prob, d in float64."""
    rows, msgs, gaps, start = [], [], [], 0
    for batch, recomputed in parts:
        if not isinstance(batch, Batch):
            raise TypeError(f"logprob_drift takes (Batch, recomputed log-probs) pairs, got {type(batch).__name__}")
        if batch.sampler_logprobs is None or batch.message_index is None:
            raise ValueError("logprob_drift needs a batch with sampled log-probs and message indices (rollouts "
                             "from a generator, encoded with encode_rollouts / rollouts_to_batch)")
        if tuple(recomputed.shape) != tuple(batch.input_ids.shape):
            raise ValueError(f"recomputed log-probs have shape {tuple(recomputed.shape)}, the batch "
                             f"{tuple(batch.input_ids.shape)}; pass (B, T) log-probs aligned with input_ids")
        old = batch.sampler_logprobs.detach().double().cpu()  # (B, T)
        new = recomputed.detach().double().cpu()  # (B, T)
        index = batch.message_index.cpu()  # (B, T)
        r, t = (torch.isfinite(old) & torch.isfinite(new) & (index >= 0)).nonzero(as_tuple=True)
        rows.append(r + start)
        msgs.append(index[r, t])
        gaps.append((new - old)[r, t])
        start += len(batch)
    if start != len(rollouts):
        raise ValueError(f"the batches hold {start} rows but {len(rollouts)} rollouts were given")
    return torch.cat(rows), torch.cat(msgs), torch.cat(gaps)


def logprob_drift(rollouts: list[Rollout], parts, band: float = 0.1) -> DriftReport:
    """Drift between sampled and recomputed log-probs, per message, role and agent.

    parts: one `(batch, recomputed)` pair or a list of them whose rows follow `rollouts` in order
    (e.g. micro-batches); recomputed is (B, T) aligned with `batch.input_ids`, NaN where unknown.
    Tokens count where both log-probs are finite and the token belongs to a message.
    """
    if not 0 < band < 1:
        raise ValueError(f"band must be in (0, 1), got {band}")
    if isinstance(parts, tuple):
        parts = [parts]
    rows, msgs, gaps = _gaps(list(rollouts), parts)
    absd = gaps.abs()
    outside = (torch.exp(gaps) < 1 - band) | (torch.exp(gaps) > 1 + band)
    messages: list[MessageDrift] = []
    groups: dict[tuple[str, str], list] = {}
    keys = torch.stack([rows, msgs], 1)
    for key in torch.unique(keys, dim=0).tolist():
        sel = (rows == key[0]) & (msgs == key[1])
        msg = rollouts[key[0]][key[1]]
        n, total, peak, out = int(sel.sum()), float(absd[sel].sum()), float(absd[sel].max()), int(outside[sel].sum())
        s = _stats(n, total, peak, out)
        messages.append(MessageDrift(**vars(s), rollout=key[0], message=key[1], role=msg.role, name=msg.name))
        for group in (("role", msg.role), ("agent", msg.name or "-")):
            acc = groups.setdefault(group, [0, 0.0, 0.0, 0])
            acc[0] += n
            acc[1] += total
            acc[2] = max(acc[2], peak)
            acc[3] += out
    overall = _stats(len(gaps), float(absd.sum()), float(absd.max()) if len(gaps) else float("nan"),
                     int(outside.sum()))
    table = lambda kind: {k[1]: _stats(*v) for k, v in sorted(groups.items()) if k[0] == kind}  # noqa: E731
    return DriftReport(overall, table("role"), table("agent"), messages, band)
