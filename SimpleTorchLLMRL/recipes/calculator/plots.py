"""Training curves for `main.py`: mean reward per step and held-out accuracy, one PNG.

    plot_curves(read_metrics("out/metrics.jsonl"), "out/curves.png", k=4)   # Agg backend: no display needed
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def plot_curves(rows: Sequence[dict], path: str | os.PathLike, k: int = 4, title: str = "") -> Path:
    """Reward (per step, and its moving average) on the left, eval accuracy and pass@k on the right."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("train/reward") is not None]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(10, 4))
    if train:
        steps = [r["step"] for r in train]
        reward = [r["train/reward"] for r in train]
        ax_r.plot(steps, reward, color="tab:blue", alpha=0.35, label="mean reward")
        window = max(1, len(reward) // 10)
        smooth = [sum(reward[max(0, i - window + 1): i + 1]) / len(reward[max(0, i - window + 1): i + 1])
                  for i in range(len(reward))]
        ax_r.plot(steps, smooth, color="tab:blue", label=f"moving average ({window})")
        if any(r.get("train/tool_rate") is not None for r in train):
            ax_r.plot(steps, [r.get("train/tool_rate") for r in train], color="tab:green", alpha=0.6,
                      label="tool-use rate")
    ax_r.set(xlabel="step", ylabel="training rollouts", title="reward", ylim=(-0.02, 1.02))
    ax_r.legend(loc="lower right", fontsize=8)
    if evals:
        steps = [r["step"] for r in evals]
        ax_a.plot(steps, [r["eval/accuracy"] for r in evals], "o-", color="tab:red", label="greedy accuracy")
        if any(r.get(f"eval/pass@{k}") is not None for r in evals):
            ax_a.plot(steps, [r.get(f"eval/pass@{k}") for r in evals], "s--", color="tab:purple",
                      label=f"pass@{k}")
    ax_a.set(xlabel="step", ylabel="held-out", title="held-out accuracy", ylim=(-0.02, 1.02))
    ax_a.legend(loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
