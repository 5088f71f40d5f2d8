"""One GRPO step, SimpleTorchLLMRL vs TRL's `GRPOTrainer`, at equal work: on CPU, or on one GPU in bf16.

Legend: V vocab, B = prompts x group sequences, N new tokens.

Model shapes (`--shape`, random init from a config, nothing downloaded; `grpo_sides.SHAPES`):

    tiny              Qwen2, 2 layers, hidden 64, tied embeddings, V from --vocab (512 and 151,936);
                      16 prompts x 4 completions = 64 sequences, N = 64
    qwen2.5-0.5b      the public Qwen2.5-0.5B config (24 layers, hidden 896, intermediate 4864,
                      14 heads / 2 KV heads, V = 151,936, tied embeddings, rope theta 1e6,
                      RMSNorm eps 1e-6; 494M parameters); 4 prompts x 4 completions = 16
                      sequences, N = 32 (sized for a 2-core CPU)
    qwen2.5-0.5b-gpu  the same model, 16 prompts x 8 completions = 128 sequences, N = 256 (--device cuda)

Both sides: the same model and tokenizer (`SimpleTorchLLMRL.testing.tiny`, ChatML), the same prompts,
G completions each, exactly N new tokens (TRL: `min_new_tokens=N`; ours: an
end-of-turn id outside the vocabulary, so no row stops early), temperature
1.0, HF `generate` on both sides, beta=0 (no reference pass), a constant
reward, fused AdamW (lr 1e-6, no weight decay) with grad-norm clipping at 1.0,
one optimizer step per B completions. CPU: float32 (TRL's bf16 and gradient
checkpointing defaults turned off). `--device cuda`: the model in bfloat16 on both
sides (TRL with `bf16=True`), and a TRL variant with Liger's kernels (`trl_liger`);
without CUDA the script says so and exits 0.

Each (variant, case) runs in a fresh process: build, one untimed warm-up
step, then timed steps (5 at the tiny shape with V=512, where a step is short and
noisy, 1 otherwise; the process reports their median), then peak memory (`ru_maxrss`;
on CUDA also `torch.cuda.max_memory_allocated`). `--runs` processes per variant,
interleaved so that machine load hits all alike; the medians over processes are
reported. Times are CPU seconds (`process_time`, 1 torch thread: robust to waiting
for a shared core) and wall seconds; on CUDA the wall clock is the one that counts
(every reading synchronizes the device). The phases and variants are described in
`grpo_sides.py`.

trl lives in the `bench` dependency group, in its own environment:

    UV_PROJECT_ENVIRONMENT=/tmp/benchvenv uv sync --group bench
    UV_PROJECT_ENVIRONMENT=/tmp/benchvenv uv run --group bench python benchmarks/grpo_vs_trl.py \
        --shape tiny qwen2.5-0.5b --runs 5 --runs-large 3
    # one GPU (needs liger-kernel beside trl for trl_liger):
    python benchmarks/grpo_vs_trl.py --device cuda --shape qwen2.5-0.5b-gpu --runs-large 3 \
        --variants ours ours_unshared trl trl_liger
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpo_sides as sides  # noqa: E402  (beside this script)

PHASES = ("generate", "old_logprobs", "loss_backward", "optimizer", "total")
CLOCKS = sides.CLOCKS
DEFAULT_VOCABS = (151_936, 512)
RESULTS = Path(__file__).resolve().parent / "results"
BASELINES = ("trl", "trl_liger")


def case_key(shape: str, vocab: int) -> str:
    return f"tiny-{vocab}" if shape == "tiny" else shape


def case_label(key: str) -> str:
    return f"tiny V={int(key.split('-')[1]):,}" if key.startswith("tiny-") else f"{key} V=151,936"


def _source_hashes() -> dict[str, str]:
    """sha1 of the library files on the hot path, so runs of different code versions can be told apart."""
    import hashlib

    root = Path(__file__).resolve().parent.parent / "SimpleTorchLLMRL"
    files = ["model/generation/generator.py", "model/generation/hf_backend.py", "model/scoring/logprobs.py",
             "model/scoring/head.py", "model/scoring/head_kernels.py", "trainer/pipeline.py",
             "model/scoring/shared_prefix.py", "trainer/grpo.py", "trainer/losses.py", "chat/tokenize.py"]
    return {f: hashlib.sha1((root / f).read_bytes()).hexdigest()[:10] for f in files if (root / f).exists()}


def _timed_run(variant: str, vocab: int, timed_steps: int, profile: str | None) -> dict:
    """One warm-up step and `timed_steps` timed ones; on CUDA the peak memory is this run's alone."""
    if sides.RUN.device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
    res = sides.run(variant, vocab, 1 + timed_steps, profile)
    timed = [st["times"] for st in res["steps"][1:]]  # step 0 is the warm-up
    res["timed"] = {c: {k: statistics.median(t[c][k] for t in timed) for k in timed[0][c]} for c in CLOCKS}
    res["run_peak_cuda_mb"] = sides.cuda_mb(True)
    return res


def child(variant: str, vocab: int, threads: int, profile: str | None = None, patch: str | None = None,
          timed_steps: int = 1, shape: str = "tiny", device: str = "cpu", dtype: str = "float32",
          gradient_checkpointing: bool = False, gc_both: bool = False) -> None:
    sides.env()
    sides.configure(shape, device, dtype, gradient_checkpointing)
    if sides.RUN.shape.model != "tiny":
        vocab = sides.QWEN25_05B["vocab_size"]
    import torch

    if patch:  # a proposed change, applied as a monkeypatch, to measure it before it lands
        import runpy

        runpy.run_path(patch, run_name="bench_patch")

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    res = _timed_run(variant, vocab, timed_steps, profile)
    if gc_both:  # the same process again with gradient checkpointing on: one model build, one import
        sides.configure(shape, device, dtype, True)
        res["gradient_checkpointing_on"] = _timed_run(variant, vocab, timed_steps, profile)
    import transformers

    res["source_sha1"] = _source_hashes()
    sh = sides.RUN.shape
    res.update(variant=variant, vocab=vocab, shape=shape, prompts=sh.prompts, group=sh.group, new_tokens=sh.new_tokens,
               device=device, dtype=dtype, gradient_checkpointing=gradient_checkpointing, patch=patch, threads=torch.get_num_threads(), peak_rss_mb=sides.maxrss_mb(),
               peak_cuda_mb=sides.cuda_mb(True), wall_s=time.perf_counter() - t0, torch=torch.__version__,
               transformers=transformers.__version__)
    if device == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    if variant in BASELINES:
        import trl

        res["trl"] = trl.__version__
    print("RESULT " + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- parent: processes, medians


def spawn(variant: str, vocab: int, threads: int, timeout: float, patch: str | None = None,
          timed_steps: int = 1, shape: str = "tiny", device: str = "cpu", dtype: str = "float32",
          gradient_checkpointing: bool = False, gc_both: bool = False) -> dict:
    """Run one variant in a fresh Python process; its RESULT line, plus the load average around it."""
    side = "ours" if variant == "ours_patched" else variant
    cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--vocab", str(vocab),
           "--threads", str(threads), "--timed-steps", str(timed_steps), "--shape", shape,
           "--device", device, "--dtype", dtype] + (["--gradient-checkpointing"] if gradient_checkpointing else []) \
        + (["--gc-both"] if gc_both else [])
    if variant == "ours_patched":
        cmd += ["--patch", patch]
    load0 = os.getloadavg()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} V={vocab} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    res["variant"] = variant
    res["loadavg_before"], res["loadavg_after"] = list(load0), list(os.getloadavg())
    return res


def summarize(runs: list[dict]) -> dict:
    """Medians over runs of the timed (last) step, per clock and phase, and of the peak memory."""
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    out = {"n": len(runs), "peak_rss_mb": med("peak_rss_mb"), "rss_after_setup_mb": med("rss_after_setup_mb"),
           "all_peak_rss_mb": [r["peak_rss_mb"] for r in runs],
           "loadavg_1min": [r["loadavg_before"][0] for r in runs]}
    out["step_rss_mb"] = out["peak_rss_mb"] - out["rss_after_setup_mb"]
    if runs[0].get("peak_cuda_mb") is not None:
        out["peak_cuda_mb"], out["cuda_after_setup_mb"] = med("peak_cuda_mb"), med("cuda_after_setup_mb")
        out["step_cuda_mb"] = out["peak_cuda_mb"] - out["cuda_after_setup_mb"]
    for clock in CLOCKS:
        timed = [r["timed"][clock] for r in runs]  # each process: median of its timed steps
        out[f"median_{clock}_s"] = {k: statistics.median(t[k] for t in timed) for k in timed[0]}
        out[f"all_total_{clock}_s"] = [t["total"] for t in timed]
    return out


def ratios(ours: dict, base: dict) -> dict:
    """Baseline time / our time per clock and phase (> 1: we are faster); our peak memory / theirs (< 1: leaner)."""
    r = {clock: {k: base[f"median_{clock}_s"][k] / ours[f"median_{clock}_s"][k] for k in PHASES
                 if ours[f"median_{clock}_s"][k] > 0} for clock in CLOCKS}
    r["peak_rss"] = ours["peak_rss_mb"] / base["peak_rss_mb"]
    r["step_rss"] = ours["step_rss_mb"] / base["step_rss_mb"]
    memory = r["peak_rss"]
    if "peak_cuda_mb" in ours and "peak_cuda_mb" in base:
        r["peak_cuda"] = memory = ours["peak_cuda_mb"] / base["peak_cuda_mb"]
        r["step_cuda"] = ours["step_cuda_mb"] / base["step_cuda_mb"]
    r["goals"] = {"speed_2x_cpu": r["cpu"]["total"] >= 2.0, "speed_2x_wall": r["wall"]["total"] >= 2.0,
                  "memory_0.5x": memory <= 0.5}
    return r


OURS = ("ours", "ours_unshared", "ours_patched")
SIDES = OURS + BASELINES


def table(results: dict, clock: str = "cpu") -> str:
    """Markdown: median seconds per phase and peak memory per side, then baseline / ours ratios."""
    rows = [f"| case | side | generate | old log-probs | loss+backward | optimizer | **step** ({clock} s) "
            "| peak RSS MiB | step RSS MiB | peak CUDA MiB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v, res in results["cases"].items():
        for side in SIDES:
            if side in res:
                m, cuda = res[side][f"median_{clock}_s"], res[side].get("peak_cuda_mb")
                rows.append(f"| {case_label(v)} | {side} | {m['generate']:.2f} | {m['old_logprobs']:.3f} | "
                            f"{m['loss_backward']:.2f} | {m['optimizer']:.3f} | **{m['total']:.2f}** | "
                            f"{res[side]['peak_rss_mb']:.0f} | {res[side]['step_rss_mb']:.0f} | "
                            f"{'-' if cuda is None else f'{cuda:.0f}'} |")
        for base in BASELINES:
            for side, r in res.get("ratios", {}).get(base, {}).items():
                c, cuda = r[clock], r.get("peak_cuda")
                rows.append(f"| {case_label(v)} | {base} / {side} | {c['generate']:.2f}x | {c['old_logprobs']:.2f}x | "
                            f"{c['loss_backward']:.2f}x | {c['optimizer']:.2f}x | **{c['total']:.2f}x** | "
                            f"{side} / {base} **{r['peak_rss']:.2f}** | {r['step_rss']:.2f} | "
                            f"{'-' if cuda is None else f'**{cuda:.2f}**'} |")
    return "\n".join(rows)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=None, choices=list(sides.SHAPES),
                    help="model shapes to run, in order (tiny runs once per --vocab); default: tiny on CPU, "
                         "qwen2.5-0.5b-gpu on CUDA")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: bf16 on one GPU (exits 0 with a message when CUDA is absent)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="the model's dtype on both sides (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="recompute activations in backward on every side (TRL's default; off by default here)")
    ap.add_argument("--gc-both", action="store_true",
                    help="child: after the run, the same process again with gradient checkpointing on")
    ap.add_argument("--runs", type=int, default=5, help="measured processes per variant at the tiny shape (>= 5)")
    ap.add_argument("--runs-large", type=int, default=3,
                    help="measured processes per variant at the Qwen2.5-0.5B shapes (minutes each on 2 cores)")
    ap.add_argument("--vocab", type=int, nargs="+", default=list(DEFAULT_VOCABS), help="vocab sizes of the tiny shape")
    ap.add_argument("--variants", nargs="+", default=None, choices=list(sides.VARIANTS),
                    help="default: ours trl on CPU; ours ours_unshared trl trl_liger on CUDA (trl_liger needs CUDA "
                         "and liger-kernel)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads in every child (equal for both sides)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results JSON (default: results/grpo_vs_trl.json, results/grpo_vs_trl_gpu.json on CUDA)")
    ap.add_argument("--warmup-process", action="store_true",
                    help="also run one discarded process per variant first (each process already runs an "
                         "untimed warm-up step)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--timed-steps", type=int, default=0,
                    help="timed steps per process after its warm-up step, median taken (0: 5 at the tiny "
                         "shape with vocab <= 50,000, where a step is short and noisy, else 1)")
    ap.add_argument("--child", choices=list(sides.VARIANTS), help="run one variant in this process (internal)")
    ap.add_argument("--profile", help="with --child: cProfile the timed step into this pstats file")
    ap.add_argument("--patch", help="a Python file run first in a child (a monkeypatch under evaluation); "
                                    "with the parent, adds the variant ours_patched")
    a = ap.parse_args()
    gpu = a.device == "cuda"
    a.shape = a.shape or (["qwen2.5-0.5b-gpu"] if gpu else ["tiny"])
    a.dtype = a.dtype or ("bfloat16" if gpu else "float32")
    a.variants = a.variants or (["ours", "ours_unshared", "ours_liger", "trl", "trl_liger"] if gpu else ["ours", "trl"])
    a.out = a.out or RESULTS / ("grpo_vs_trl_gpu.json" if gpu else "grpo_vs_trl.json")
    if {"trl_liger", "ours_liger"} & set(a.variants) and not gpu:
        ap.error("trl_liger and ours_liger need --device cuda: Liger's kernels are Triton GPU kernels")
    if gpu and not cuda_available():
        print("grpo_vs_trl.py --device cuda: CUDA is not available on this machine, nothing was measured "
              "(see docs/benchmarks.md#gpu)")
        return
    steps_for = lambda sh, v: a.timed_steps or (5 if sh == "tiny" and v <= 50_000 else 1)  # noqa: E731
    if a.child:
        child(a.child, a.vocab[0], a.threads, a.profile, a.patch, steps_for(a.shape[0], a.vocab[0]), a.shape[0],
              a.device, a.dtype, a.gradient_checkpointing, a.gc_both)
        return
    cases = [(sh, v) for sh in a.shape for v in (a.vocab if sh == "tiny" else [sides.QWEN25_05B["vocab_size"]])]
    runs_for = lambda sh: a.runs if sh == "tiny" else a.runs_large  # noqa: E731
    variants = list(a.variants) + (["ours_patched"] if a.patch else [])
    results = {"config": {"threads": a.threads, "device": a.device, "dtype": a.dtype,
                          "gradient_checkpointing": a.gradient_checkpointing,
                          "shapes": {sh: {"prompts": sides.SHAPES[sh].prompts, "group": sides.SHAPES[sh].group,
                                          "new_tokens": sides.SHAPES[sh].new_tokens,
                                          "model": sides.SHAPES[sh].description, "runs": runs_for(sh)}
                                     for sh in a.shape},
                          "timed_steps": {case_key(sh, v): steps_for(sh, v) for sh, v in cases},
                          "patch": a.patch, "cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "started": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_start": list(os.getloadavg())},
               "cases": {}}
    for shape, vocab in cases:
        key, n_steps = case_key(shape, vocab), steps_for(shape, vocab)
        runs: dict[str, list] = {v: [] for v in variants}
        go = lambda v: spawn(v, vocab, a.threads, a.timeout, a.patch, n_steps, shape,  # noqa: E731, B023
                             a.device, a.dtype, a.gradient_checkpointing)
        for v in variants if a.warmup_process else []:
            print(f"[{key}] warm-up process {v}", flush=True)
            go(v)
        for i in range(runs_for(shape)):
            for v in variants if i % 2 == 0 else variants[::-1]:  # interleaved: load drifts hit all alike
                r = go(v)
                runs[v].append(r)
                tt = r["timed"]
                cuda = "" if r.get("peak_cuda_mb") is None else f", peak CUDA {r['peak_cuda_mb']:.0f} MiB"
                print(f"[{key}] run {i + 1}/{runs_for(shape)} {v}: step {tt['wall']['total']:.2f} s wall, "
                      f"{tt['cpu']['total']:.2f} s cpu, peak RSS {r['peak_rss_mb']:.0f} MiB{cuda}, "
                      f"load {r['loadavg_before'][0]:.1f}", flush=True)
        res = {v: summarize(rs) for v, rs in runs.items()}
        res["ratios"] = {base: {v: ratios(res[v], res[base]) for v in OURS if v in res}
                         for base in BASELINES if base in res}
        res["runs"] = runs
        results["cases"][key] = res
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1))  # after every case, so a crash keeps what was measured
    results["config"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results["config"]["loadavg_end"] = list(os.getloadavg())
    a.out.write_text(json.dumps(results, indent=1))
    for clock in CLOCKS:
        print(table(results, clock))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
