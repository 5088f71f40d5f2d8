"""Combine the metrics of micro-batches into the metrics of the whole batch.

    outs = []
    for micro in prepared.split(4):
        out = grpo.compute(micro)           # LossOutput(loss, metrics, token_logprobs)
        out.loss.backward()
        outs.append(out)
    metrics = combine_metrics([o.metrics for o in outs])   # what one full-batch call would report

Each micro-batch's loss already carries the FULL batch's normalizer, so losses add
up to the full-batch loss. Per-token statistics are weighted by `num_tokens`;
min / max are taken over the parts; counts are summed; batch-level numbers
(rewards, advantages, temperature) are the same in every part and kept once.
"""

from __future__ import annotations

SUMMED = frozenset({"loss", "policy_loss", "value_loss", "num_tokens", "num_sequences",
                    # DPO's per-pair means, each a share of the full batch's (divided by its pair count)
                    "reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward"})
TOKEN_MEANS = frozenset({"entropy", "ratio_mean", "clip_frac_low", "clip_frac_high", "clip_frac", "kl",
                         "tis_weight_mean", "value_mean", "return_mean", "advantage_mean",
                         "reverse_kl", "jsd", "nll"})  # distillation and SFT
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
        elif key in TOKEN_MEANS:
            weights = [p.get("num_tokens") for p in present]
            if any(w is None for w in weights):
                raise ValueError(f"combine_metrics: {key!r} is a token mean but a part has no 'num_tokens'")
            total = sum(weights)
            out[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0
        else:
            out[key] = values[0]
    return out
