"""Plot benchmarks/results/grpo_vs_trl.json: speed and memory ratios against TRL, and the phase split.

    uv run python benchmarks/plot_perf.py [--json benchmarks/results/grpo_vs_trl.json] [--out docs/perf.png]

Top left: TRL step time / ours (higher is better; goal 2x), CPU seconds and wall seconds.
Top right: our peak RSS / TRL's (lower is better; goal 0.5x).
Bottom: median CPU seconds per phase of one GRPO step, one panel per case (model shape and vocabulary).
Reads both layouts: "cases" (tiny-512, qwen2.5-0.5b, ...) and the older "vocabs".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results"
PHASES = ("generate", "old_logprobs", "loss_backward", "optimizer")
LABELS = {"ours": "ours", "ours_unshared": "ours, prompts not shared", "ours_patched": "ours + proposed", "trl": "TRL"}
COLORS = {"ours": "tab:blue", "ours_unshared": "tab:cyan", "ours_patched": "tab:green", "trl": "tab:orange"}
PHASE_COLORS = {"generate": "#9467bd", "old_logprobs": "#bcbd22", "loss_backward": "#17becf", "optimizer": "#d62728"}


def _bars(ax, groups: list[str], series: dict[str, tuple[list[float], str, str]], goal: float, ylabel: str,
          better: str):
    """series: name -> (values per group, color, hatch)."""
    import numpy as np

    x = np.arange(len(groups))
    width = 0.8 / max(1, len(series))
    for i, (name, (vals, color, hatch)) in enumerate(series.items()):
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=name, color=color,
                      hatch=hatch, edgecolor="white" if hatch else None)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in vals], fontsize=8)
    ax.axhline(goal, color="crimson", linestyle="--", linewidth=1, label=f"goal {goal}x ({better})")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(x, groups)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def _label(key: str) -> str:
    if key.startswith("tiny-"):
        return f"tiny, V={int(key.split('-')[1]):,}"
    return key if key.startswith("V=") else f"{key}, V=151,936"


def _vs_trl(case: dict) -> dict:
    """Ratios against TRL per side: {"trl": {side: ...}} since the GPU variants, {side: ...} before."""
    r = case.get("ratios", {})
    return r["trl"] if "trl" in r else r


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results.get("cases") or {f"V={int(v):,}": r for v, r in results["vocabs"].items()}
    vocabs = list(cases)
    names = [_label(v) for v in vocabs]
    vs_trl = {v: _vs_trl(cases[v]) for v in vocabs}
    sides = [s for s in ("ours", "ours_unshared", "ours_patched") if any(s in vs_trl[v] for v in vocabs)]
    fig = plt.figure(figsize=(11, 8), constrained_layout=True)
    grid = fig.add_gridspec(2, max(2, len(vocabs)))
    ax_speed, ax_mem = fig.add_subplot(grid[0, : grid.ncols // 2]), fig.add_subplot(grid[0, grid.ncols // 2:])

    speed, mem = {}, {}
    for s in sides:
        r = [vs_trl[v].get(s) for v in vocabs]
        speed[f"{LABELS[s]}, CPU s"] = ([x["cpu"]["total"] if x else 0 for x in r], COLORS[s], "")
        speed[f"{LABELS[s]}, wall s"] = ([x["wall"]["total"] if x else 0 for x in r], COLORS[s], "//")
        mem[LABELS[s]] = ([x["peak_rss"] if x else 0 for x in r], COLORS[s], "")
    _bars(ax_speed, names, speed, 2.0, "TRL step time / ours", "higher is better")
    ax_speed.set_title("GRPO step speed-up over TRL GRPOTrainer")
    _bars(ax_mem, names, mem, 0.5, "our peak RSS / TRL's", "lower is better")
    ax_mem.set_title("Peak memory (RSS) relative to TRL")

    for i, v in enumerate(vocabs):
        ax = fig.add_subplot(grid[1, i])
        res = cases[v]
        present = [s for s in LABELS if s in res]
        bottom = [0.0] * len(present)
        for ph in PHASES:
            vals = [res[s]["median_cpu_s"][ph] for s in present]
            ax.bar([LABELS[s] for s in present], vals, bottom=bottom, label=ph.replace("_", " "),
                   color=PHASE_COLORS[ph])
            bottom = [b + x for b, x in zip(bottom, vals, strict=True)]
        for j, s in enumerate(present):
            ax.annotate(f"{res[s]['median_cpu_s']['total']:.2f} s", (j, bottom[j]), ha="center", va="bottom",
                        fontsize=8)
        ax.set_title(f"{_label(v)}: median CPU s per phase", fontsize=9)
        ax.set_ylabel("CPU seconds")
        ax.legend(fontsize=7)
    cfg = results["config"]
    if "shapes" in cfg:
        work = "\n" + "; ".join(f"{sh}: {c['prompts']} prompts x {c.get('group', cfg.get('group'))} completions x "
                                 f"{c['new_tokens']} new tokens, "
                         f"median of {c['runs']} processes" for sh, c in cfg["shapes"].items())
    else:
        work = (f"{cfg['prompts']} prompts x {cfg['group']} completions, {cfg['new_tokens']} new tokens, "
                f"median of {cfg['runs']} processes")
    where = "one GPU, bf16" if cfg.get("device") == "cuda" else f"CPU, {cfg['threads']} thread(s)"
    fig.suptitle(f"GRPO step vs TRL GRPOTrainer on {where}. {work}", fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=HERE / "grpo_vs_trl.json")
    ap.add_argument("--out", type=Path, default=HERE.parent.parent / "docs" / "perf.png")
    a = ap.parse_args()
    plot(json.loads(a.json.read_text()), a.out)


if __name__ == "__main__":
    main()
