"""Combine the metrics of micro-batches into the metrics of the whole batch.

    outs = []
    for micro in prepared.split(4):
        out = grpo.compute(micro)           # LossOutput(loss, metrics, token_logprobs)
        out.loss.backward()
        outs.append(out)
    metrics = combine_metrics([o.metrics for o in outs])   # what one full-batch call would report

Each micro-batch's loss already carries the FULL batch's normalizer, so losses add
up to the full-batch loss. Per-token statistics are weighted by `num_tokens` (per-rollout ones
by `num_sequences`); statistics that are not means (the off-policy ESS) are recomputed from the combined means;
min / max are taken over the parts; counts are summed; batch-level numbers
(rewards, advantages, temperature) are the same in every part and kept once.

A loss call's metrics are a `LazyMetrics`: a dict whose values stay 0-dim tensors on the
model's device until someone reads one, so nothing waits for the device between the
forward's start and the backward's end; the first read turns them all into numbers at once.
"""

from __future__ import annotations

import torch

from SimpleTorchLLMRL.trainer.off_policy import derived_mismatch

SUMMED = frozenset({"loss", "policy_loss", "value_loss", "num_tokens", "num_sequences",
                    # DPO's per-pair means, each a share of the full batch's (divided by its pair count)
                    "reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward"})
TOKEN_MEANS = frozenset({"entropy", "ratio_mean", "clip_frac_low", "clip_frac_high", "clip_frac", "kl",
                         "tis_weight_mean", "value_mean", "return_mean", "advantage_mean",
                         "reverse_kl", "jsd", "nll",  # distillation and SFT
                         "offpolicy_kl_k1", "offpolicy_kl_k3", "offpolicy_ratio_mean", "offpolicy_chi2_token",
                         "offpolicy_clipped_frac", "offpolicy_masked_frac"})
SEQUENCE_MEANS = frozenset({"offpolicy_chi2_seq", "offpolicy_masked_seq_frac"})  # weighted by num_sequences
MINIMA = frozenset({"ratio_min"})
MAXIMA = frozenset({"ratio_max"})


def combine_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of one batch from those of its micro-batches (each with `num_tokens` when it has token means)."""
    if not parts:
        raise ValueError("combine_metrics needs the metrics of at least one micro-batch")
    out: dict[str, float] = {}
    keys = dict.fromkeys(k for p in parts for k in p)  # first-seen order
    for key in keys:
        present = [p for p in parts if key in p]
        values = [p[key] for p in present]
        if key in SUMMED:
            out[key] = sum(values)
        elif key in MINIMA:
            out[key] = min(values)
        elif key in MAXIMA:
            out[key] = max(values)
        elif key in TOKEN_MEANS or key in SEQUENCE_MEANS:
            count = "num_tokens" if key in TOKEN_MEANS else "num_sequences"
            weights = [p.get(count) for p in present]
            if any(w is None for w in weights):
                raise ValueError(f"combine_metrics: {key!r} is a mean over {count[4:]} but a part has no {count!r}")
            total = sum(weights)
            out[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0
        else:
            out[key] = values[0]
    out.update(derived_mismatch(out))  # ratios of combined means (ESS, perplexity ratio), not means of ratios
    return out


class LazyMetrics(dict):
    """A dict of metrics whose tensor values become Python numbers on the first read, all in one transfer.

    The loss units put 0-dim tensors here (no `.item()`, which would wait for the device in the
    middle of a step); reading a value, iterating, `items()`, `dict(m)`, `{**m}` or `json.dumps(m)`
    after `backward()` materializes every value at once (floats; ints for integer tensors).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lazy = any(isinstance(v, torch.Tensor) for v in dict.values(self))

    @classmethod
    def merged(cls, *parts, **extra) -> LazyMetrics:
        """The parts' entries in order (later ones win), without materializing any of them."""
        out = cls()
        for part in parts:
            dict.update(out, dict.items(part))
        dict.update(out, extra)
        out._lazy = any(isinstance(v, torch.Tensor) for v in dict.values(out))
        return out

    def materialize(self) -> LazyMetrics:
        """Turn every tensor value into a number (one device-to-host copy); returns self."""
        if not self._lazy:
            return self
        keys = [k for k, v in dict.items(self) if isinstance(v, torch.Tensor)]
        if keys:
            tensors = [dict.__getitem__(self, k).detach() for k in keys]
            values = torch.stack([t.reshape(()).to(torch.float64) for t in tensors]).tolist()
            for k, t, v in zip(keys, tensors, values, strict=True):
                is_int = not (t.is_floating_point() or t.is_complex())
                dict.__setitem__(self, k, int(v) if is_int else v)
        self._lazy = False
        return self

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, value)
        self._lazy = self._lazy or isinstance(value, torch.Tensor)

    def __getitem__(self, key):
        return dict.__getitem__(self.materialize(), key)

    def get(self, key, default=None):
        return dict.get(self.materialize(), key, default)

    def __iter__(self):  # also takes `dict(m)` / `{**m}` off CPython's raw-storage fast path
        return dict.__iter__(self.materialize())

    def items(self):
        return dict.items(self.materialize())

    def values(self):
        return dict.values(self.materialize())

    def copy(self) -> LazyMetrics:
        return LazyMetrics.merged(self)

    def __repr__(self) -> str:
        return dict.__repr__(self.materialize())

    def __eq__(self, other):
        return dict.__eq__(self.materialize(), other)

    __hash__ = None

    def __reduce__(self):
        return dict, (dict(self.items()),)
