"""Combine the metrics of micro-batches into the metrics of the whole batch.

    outs = [grpo.compute(micro) for micro in prepared.split(4)]    # each: loss.backward() too
    metrics = combine_metrics([o.metrics for o in outs])           # what one full-batch call reports

Each metric carries its reduction (`losses.Reduce`, set by the unit that made it): sums (each part's
loss carries the FULL batch's normalizer), means weighted by a count metric, min / max, values derived
from the combined ones (the off-policy ESS), batch-level numbers kept once. No list of names.
"""

from __future__ import annotations

from SimpleTorchLLMRL.trainer.losses import FIRST


def combine_metrics(parts: list[dict]) -> dict[str, float]:
    """The metrics of one batch from the `LazyMetrics` of its micro-batches (each says how it combines)."""
    if not parts:
        raise ValueError("combine_metrics needs the metrics of at least one micro-batch")
    missing = [i for i, p in enumerate(parts) if not hasattr(p, "reductions")]
    if missing:
        raise TypeError(f"combine_metrics: parts {missing} carry no reductions; pass the `metrics` of the "
                        "LossOutputs (a LazyMetrics), not plain dicts")
    out: dict[str, float] = {}
    derived = {}
    for key in dict.fromkeys(k for p in parts for k in p):  # first-seen order
        present = [p for p in parts if key in p]
        how = next((p.reductions[key] for p in present if key in p.reductions), FIRST)
        values = [p[key] for p in present]
        if how.how == "sum":
            out[key] = sum(values)
        elif how.how in ("min", "max"):
            out[key] = (min if how.how == "min" else max)(values)
        elif how.how == "mean":
            weights = [p.get(how.weight) for p in present]
            if any(w is None for w in weights):
                raise ValueError(f"combine_metrics: {key!r} is a mean weighted by {how.weight!r}, which a part lacks")
            total = sum(weights)
            out[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0
        elif how.how == "derived":
            derived[key] = how.derive
            out[key] = values[0]
        else:
            out[key] = values[0]
    out.update({key: derive(out) for key, derive in derived.items()})  # from the combined values
    return out
