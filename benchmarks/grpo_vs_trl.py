"""One GRPO step, SimpleTorchLLMRL vs TRL's `GRPOTrainer`, at equal work on CPU.

Legend: V vocab, B = prompts x completions sequences, N new tokens.

Two model shapes (`--shape`, both random init from a config, nothing downloaded):

    tiny          Qwen2, 2 layers, hidden 64, tied embeddings, V from --vocab (512 and 151,936);
                  16 prompts x 4 completions = 64 sequences, N = 64
    qwen2.5-0.5b  the public Qwen2.5-0.5B config (24 layers, hidden 896, intermediate 4864,
                  14 heads / 2 KV heads, V = 151,936, tied embeddings, rope theta 1e6,
                  RMSNorm eps 1e-6; 494M parameters); 4 prompts x 4 completions = 16
                  sequences, N = 32 (sized for a 2-core CPU)

Both sides: the same model and tokenizer (`SimpleTorchLLMRL.testing.tiny`, ChatML), the same prompts,
4 completions each, exactly N new tokens (TRL: `min_new_tokens=N`; ours: an
end-of-turn id outside the vocabulary, so no row stops early), temperature
1.0, HF `generate` on both sides, beta=0 (no reference pass), a constant
reward, float32 (TRL's bf16 and gradient checkpointing defaults are turned
off), fused AdamW (lr 1e-6, no weight decay) with grad-norm clipping at 1.0,
one optimizer step per B completions.

Each (variant, case) runs in a fresh process: build, one untimed warm-up
step, then timed steps (5 at the tiny shape with V=512, where a step is short and
noisy, 1 otherwise; the process reports their median), then `ru_maxrss`.
`--runs` processes per variant, interleaved ours/TRL so that machine load hits
both alike; the medians over processes are reported. Times are CPU seconds
(`process_time`, 1 torch thread: robust to waiting for a shared core) and wall
seconds.

Phases of the timed step:
    generate      prompts -> sampled completions (tokenize, model.generate, decode)
    old_logprobs  encode/collate, rewards, advantages, and an old-policy log-prob
                  pass if the side needs one (neither does here)
    loss_backward policy log-probs, loss, backward
    optimizer     grad clipping, optimizer.step, zero_grad (TRL: + lr scheduler)
    total         the whole step (TRL: on_step_end to on_step_end, so all its overhead)

trl lives in the `bench` dependency group, in its own environment:

    UV_PROJECT_ENVIRONMENT=/tmp/benchvenv uv sync --group bench
    UV_PROJECT_ENVIRONMENT=/tmp/benchvenv uv run --group bench python benchmarks/grpo_vs_trl.py \
        --shape tiny qwen2.5-0.5b --runs 5 --runs-large 3
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

PHASES = ("generate", "old_logprobs", "loss_backward", "optimizer", "total")
CLOCKS = ("wall", "cpu")  # perf_counter and process_time: with 1 thread, CPU seconds do not count waiting for a core
GROUP, LR = 4, 1e-6
DEFAULT_VOCABS = (151_936, 512)
QWEN25_05B = dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                  use_sliding_window=False, sliding_window=32_768, max_window_layers=24, attention_dropout=0.0,
                  initializer_range=0.02)
# shape -> (prompts, new tokens, model description)
SHAPES = {"tiny": (16, 64, "Qwen2 random init, 2 layers, hidden 64, tied embeddings"),
          "qwen2.5-0.5b": (4, 32, "Qwen2.5-0.5B config, random init: 24 layers, hidden 896, 14/2 heads, "
                                  "V=151,936, tied embeddings (494M parameters)")}
NUM_PROMPTS, NEW_TOKENS = SHAPES["tiny"][:2]  # set per process by _set_shape


def _set_shape(shape: str) -> None:
    global NUM_PROMPTS, NEW_TOKENS
    NUM_PROMPTS, NEW_TOKENS = SHAPES[shape][:2]


def case_key(shape: str, vocab: int) -> str:
    return f"tiny-{vocab}" if shape == "tiny" else shape


def case_label(key: str) -> str:
    return f"tiny V={int(key.split('-')[1]):,}" if key.startswith("tiny-") else f"{key} V=151,936"
RESULTS = Path(__file__).resolve().parent / "results" / "grpo_vs_trl.json"


def prompts() -> list[str]:
    return [f"What is {i + 12} + {3 * i + 35}? Think, then answer in \\boxed{{}}." for i in range(NUM_PROMPTS)]


def constant_reward(prompts=None, completions=None, **kwargs):
    """TRL's reward-function signature: 1.0 for every completion."""
    return [1.0] * len(completions)


# ----------------------------------------------------------------------------- child: one process, one variant


def _env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _maxrss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class _Profile:
    """cProfile (CPU-time clock) of the last (timed) step when --profile is given; a no-op otherwise."""

    def __init__(self, path: str | None, steps: int):
        import cProfile

        self.path, self.last = path, steps - 1
        self.prof = cProfile.Profile(time.process_time) if path else None

    def start(self, step: int) -> None:
        if self.prof is not None and step == self.last:
            self.prof.enable()

    def stop(self, step: int) -> None:
        if self.prof is not None and step == self.last:
            self.prof.disable()
            self.prof.dump_stats(self.path)


def _build(vocab: int, shape: str = "tiny"):
    from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer("chatml")
    if shape == "tiny":
        return tok, tiny_model("qwen2", tok, vocab_size=vocab, hidden_size=64, num_layers=2)
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**QWEN25_05B, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return tok, model.eval()


class _Timers:
    """Accumulated (wall, CPU) seconds of wrapped methods; wraps instance attributes, so only that object."""

    def __init__(self):
        self.acc: dict[str, tuple[float, float]] = {}

    def wrap(self, obj, name: str, key: str | None = None) -> None:
        fn = getattr(obj, name)
        key = key or name

        def timed(*a, **k):
            c0 = _clock()
            try:
                return fn(*a, **k)
            finally:
                c1, acc = _clock(), self.acc.get(key, (0.0, 0.0))
                self.acc[key] = (acc[0] + c1[0] - c0[0], acc[1] + c1[1] - c0[1])

        setattr(obj, name, timed)

    def snapshot(self) -> dict[str, tuple[float, float]]:
        return dict(self.acc)


def run_ours(vocab: int, steps: int = 2, profile: str | None = None, shape: str = "tiny") -> dict:
    import torch

    from SimpleTorchLLMRL.chat.message import Message, Rollout
    from SimpleTorchLLMRL.model.generate import ModelGenerate
    from SimpleTorchLLMRL.trainer.GRPO import GRPO

    tok, model = _build(vocab, shape)
    gen = ModelGenerate(model, tok, max_new_tokens=NEW_TOKENS, temperature=1.0,
                        eos_token_ids=[vocab + 7])  # never sampled: every row runs N tokens, like min_new_tokens
    grpo = GRPO(model, tok, beta=0.0, group_size=GROUP, temperature=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    base = [Rollout([Message(p)]) for p in prompts()]
    timers = _Timers()
    timers.wrap(model, "generate", "model_generate")
    setup = {"rss_after_setup_mb": _rss_mb(), "maxrss_after_setup_mb": _maxrss_mb()}
    steps_out = []
    prof = _Profile(profile, steps)
    for step in range(steps):
        torch.manual_seed(step)
        prof.start(step)
        acc0 = timers.snapshot()
        c0 = _clock()
        rollouts = gen.group_rollout_generate_response(base, n=GROUP)  # B rollouts
        c1 = _clock()
        rewards = torch.tensor(constant_reward(completions=rollouts))
        tb = grpo.prepare(rollouts, rewards)
        c2 = _clock()
        model.train()
        loss = grpo.calculate_loss(tb)
        loss.backward()
        c3 = _clock()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        c4 = _clock()
        prof.stop(step)
        acc1 = timers.snapshot()["model_generate"]
        t = {clock: dict(generate=c1[i] - c0[i], old_logprobs=c2[i] - c1[i], loss_backward=c3[i] - c2[i],
                         optimizer=c4[i] - c3[i], total=c4[i] - c0[i],
                         model_generate=acc1[i] - acc0.get("model_generate", (0.0, 0.0))[i])
             for i, clock in enumerate(CLOCKS)}
        steps_out.append({"times": t, "old_logprob_pass": tb.old_logprobs is not None,
                          "seq_shape": list(tb.batch.input_ids.shape), "trained_tokens": int(tb.mask.sum()),
                          "new_tokens": [len(r[-1].token_ids) for r in rollouts]})
    return {**setup, "steps": steps_out}


def run_trl(vocab: int, steps: int = 2, profile: str | None = None, shape: str = "tiny") -> dict:
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok, model = _build(vocab, shape)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts()]})
    out_dir = tempfile.mkdtemp(prefix="trl_bench_")
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, report_to="none", bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=NUM_PROMPTS * GROUP,
        gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=NEW_TOKENS,
        generation_kwargs={"min_new_tokens": NEW_TOKENS}, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type="grpo", scale_rewards="group", learning_rate=LR, weight_decay=0.0,
        optim="adamw_torch_fused", max_grad_norm=1.0, max_steps=steps, logging_steps=10_000,
        save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=constant_reward, args=args, train_dataset=data,
                          processing_class=tok)
    timers = _Timers()
    timers.wrap(trainer, "_generate", "generate")
    timers.wrap(trainer, "_generate_and_score_completions", "score")
    timers.wrap(trainer, "_prepare_inputs", "prepare_inputs")
    timers.wrap(trainer, "training_step", "training_step")
    timers.wrap(trainer, "_get_per_token_logps_and_entropies", "logps_forward")
    timers.wrap(model, "generate", "model_generate")
    marks: list[dict] = []
    captured: dict = {}
    prof = _Profile(profile, steps)

    class Marks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            prof.start(state.global_step)
            marks.append({"event": "begin", "t": _clock(), "acc": timers.snapshot()})

        def on_step_end(self, args, state, control, **kw):
            marks.append({"event": "end", "t": _clock(), "acc": timers.snapshot()})
            prof.stop(state.global_step - 1)

    # training_step's end is the optimizer phase's start: wrap it to stamp that moment
    ts = trainer.training_step

    def training_step(*a, **k):
        r = ts(*a, **k)
        marks.append({"event": "after_training_step", "t": _clock(), "acc": timers.snapshot()})
        return r

    trainer.training_step = training_step
    orig_score = trainer._generate_and_score_completions

    def score(inputs):
        out = orig_score(inputs)
        captured["shape"] = [int(out["prompt_ids"].shape[0]),
                             int(out["prompt_ids"].shape[1] + out["completion_ids"].shape[1])]
        captured["new_tokens"] = out["completion_mask"].sum(-1).tolist()
        captured["old_logprob_pass"] = out.get("old_per_token_logps") is not None
        return out

    trainer._generate_and_score_completions = score
    trainer.add_callback(Marks())
    setup = {"rss_after_setup_mb": _rss_mb(), "maxrss_after_setup_mb": _maxrss_mb(),
             "optimizer": None}
    torch.manual_seed(0)
    trainer.train()
    setup["optimizer"] = type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__
    steps_out = []
    ends = [m for m in marks if m["event"] == "end"]
    begins = [m for m in marks if m["event"] == "begin"]
    afters = [m for m in marks if m["event"] == "after_training_step"]
    for k in range(len(ends)):
        b, a, e = begins[k], afters[k], ends[k]
        t = {}
        for i, clock in enumerate(CLOCKS):
            d = lambda key: e["acc"].get(key, (0.0, 0.0))[i] - b["acc"].get(key, (0.0, 0.0))[i]  # noqa: E731, B023
            gen_t, score_t, prep_t, step_t = d("generate"), d("score"), d("prepare_inputs"), d("training_step")
            t[clock] = {"generate": gen_t, "old_logprobs": prep_t - gen_t, "loss_backward": step_t - prep_t,
                        "optimizer": e["t"][i] - a["t"][i], "total": e["t"][i] - (ends[k - 1] if k else b)["t"][i],
                        "model_generate": d("model_generate"), "score": score_t, "logps_forward": d("logps_forward")}
        steps_out.append({"times": t})
    steps_out[-1].update(seq_shape=captured.get("shape"), new_tokens=captured.get("new_tokens"),
                         old_logprob_pass=captured.get("old_logprob_pass"))
    return {**setup, "steps": steps_out}


def _source_hashes() -> dict[str, str]:
    """sha1 of the library files on the hot path, so runs of different code versions can be told apart."""
    import hashlib

    root = Path(__file__).resolve().parent.parent / "SimpleTorchLLMRL"
    files = ["model/generate.py", "model/hf_backend.py", "model/logprobs.py", "trainer/GRPO.py",
             "trainer/losses.py", "chat/tokenize.py"]
    return {f: hashlib.sha1((root / f).read_bytes()).hexdigest()[:10] for f in files if (root / f).exists()}


def child(variant: str, vocab: int, threads: int, profile: str | None = None, patch: str | None = None,
          timed_steps: int = 1, shape: str = "tiny") -> None:
    _env()
    _set_shape(shape)
    if shape != "tiny":
        vocab = QWEN25_05B["vocab_size"]
    import torch

    if patch:  # a proposed change, applied as a monkeypatch, to measure it before it lands
        import runpy

        runpy.run_path(patch, run_name="bench_patch")

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    res = (run_ours if variant == "ours" else run_trl)(vocab, steps=1 + timed_steps, profile=profile, shape=shape)
    timed = [st["times"] for st in res["steps"][1:]]  # step 0 is the warm-up
    res["timed"] = {c: {k: statistics.median(t[c][k] for t in timed) for k in timed[0][c]} for c in CLOCKS}
    import transformers

    res["source_sha1"] = _source_hashes()
    res.update(variant=variant, vocab=vocab, shape=shape, prompts=NUM_PROMPTS, new_tokens=NEW_TOKENS, patch=patch, threads=torch.get_num_threads(), peak_rss_mb=_maxrss_mb(),
               wall_s=time.perf_counter() - t0, torch=torch.__version__, transformers=transformers.__version__)
    if variant == "trl":
        import trl

        res["trl"] = trl.__version__
    print("RESULT " + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- parent: processes, medians


def spawn(variant: str, vocab: int, threads: int, timeout: float, patch: str | None = None,
          timed_steps: int = 1, shape: str = "tiny") -> dict:
    """Run one variant in a fresh Python process; its RESULT line, plus the load average around it."""
    side = "trl" if variant == "trl" else "ours"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--vocab", str(vocab),
           "--threads", str(threads), "--timed-steps", str(timed_steps), "--shape", shape]
    if variant == "ours_patched":
        cmd += ["--patch", patch]
    load0 = os.getloadavg()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} V={vocab} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    res["loadavg_before"], res["loadavg_after"] = list(load0), list(os.getloadavg())
    return res


def summarize(runs: list[dict]) -> dict:
    """Medians over runs of the timed (last) step, per clock and phase, and of the peak RSS."""
    out = {"n": len(runs), "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
           "rss_after_setup_mb": statistics.median(r["rss_after_setup_mb"] for r in runs),
           "all_peak_rss_mb": [r["peak_rss_mb"] for r in runs],
           "loadavg_1min": [r["loadavg_before"][0] for r in runs]}
    out["step_rss_mb"] = out["peak_rss_mb"] - out["rss_after_setup_mb"]
    for clock in CLOCKS:
        timed = [r["timed"][clock] for r in runs]  # each process: median of its timed steps
        out[f"median_{clock}_s"] = {k: statistics.median(t[k] for t in timed) for k in timed[0]}
        out[f"all_total_{clock}_s"] = [t["total"] for t in timed]
    return out


def ratios(ours: dict, trl: dict) -> dict:
    """TRL time / our time per clock and phase (> 1: we are faster); our peak RSS / TRL's (< 1: leaner)."""
    r = {clock: {k: trl[f"median_{clock}_s"][k] / ours[f"median_{clock}_s"][k] for k in PHASES
                 if ours[f"median_{clock}_s"][k] > 0} for clock in CLOCKS}
    r["peak_rss"] = ours["peak_rss_mb"] / trl["peak_rss_mb"]
    r["step_rss"] = ours["step_rss_mb"] / trl["step_rss_mb"]
    r["goals"] = {"speed_2x_cpu": r["cpu"]["total"] >= 2.0, "speed_2x_wall": r["wall"]["total"] >= 2.0,
                  "memory_0.5x": r["peak_rss"] <= 0.5}
    return r


SIDES = ("ours", "ours_patched", "trl")


def table(results: dict, clock: str = "cpu") -> str:
    """Markdown: median seconds per phase and peak RSS per side, then TRL / ours ratios."""
    rows = [f"| case | side | generate | old log-probs | loss+backward | optimizer | **step** ({clock} s) "
            "| peak RSS MiB | step RSS MiB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for v, res in results["cases"].items():
        for side in SIDES:
            if side in res:
                m = res[side][f"median_{clock}_s"]
                rows.append(f"| {case_label(v)} | {side} | {m['generate']:.2f} | {m['old_logprobs']:.3f} | "
                            f"{m['loss_backward']:.2f} | {m['optimizer']:.3f} | **{m['total']:.2f}** | "
                            f"{res[side]['peak_rss_mb']:.0f} | {res[side]['step_rss_mb']:.0f} |")
        for side in SIDES[:2]:
            r = res.get("ratios", {}).get(side)
            if r:
                c = r[clock]
                rows.append(f"| {case_label(v)} | TRL / {side} | {c['generate']:.2f}x | {c['old_logprobs']:.2f}x | "
                            f"{c['loss_backward']:.2f}x | {c['optimizer']:.2f}x | **{c['total']:.2f}x** | "
                            f"{side} / TRL **{r['peak_rss']:.2f}** | {r['step_rss']:.2f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["tiny"], choices=list(SHAPES),
                    help="model shapes to run, in order (tiny runs once per --vocab)")
    ap.add_argument("--runs", type=int, default=5, help="measured processes per variant at the tiny shape (>= 5)")
    ap.add_argument("--runs-large", type=int, default=3,
                    help="measured processes per variant at qwen2.5-0.5b (a process takes minutes on 2 cores)")
    ap.add_argument("--vocab", type=int, nargs="+", default=list(DEFAULT_VOCABS), help="vocab sizes of the tiny shape")
    ap.add_argument("--variants", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads in every child (equal for both sides)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--warmup-process", action="store_true",
                    help="also run one discarded process per variant first (each process already runs an "
                         "untimed warm-up step)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--timed-steps", type=int, default=0,
                    help="timed steps per process after its warm-up step, median taken (0: 5 at the tiny "
                         "shape with vocab <= 50,000, where a step is short and noisy, else 1)")
    ap.add_argument("--child", choices=["ours", "trl"], help="run one variant in this process (internal)")
    ap.add_argument("--profile", help="with --child: cProfile the timed step into this pstats file")
    ap.add_argument("--patch", help="a Python file run first in a child (a monkeypatch under evaluation); "
                                    "with the parent, adds the variant ours_patched")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.vocab[0], a.threads, a.profile, a.patch, a.timed_steps, a.shape[0])
        return
    cases = [(sh, v) for sh in a.shape for v in (a.vocab if sh == "tiny" else [QWEN25_05B["vocab_size"]])]
    steps_for = lambda sh, v: a.timed_steps or (5 if sh == "tiny" and v <= 50_000 else 1)  # noqa: E731
    runs_for = lambda sh: a.runs if sh == "tiny" else a.runs_large  # noqa: E731
    variants = list(a.variants) + (["ours_patched"] if a.patch else [])
    results = {"config": {"group": GROUP, "threads": a.threads,
                          "shapes": {sh: {"prompts": SHAPES[sh][0], "new_tokens": SHAPES[sh][1],
                                          "model": SHAPES[sh][2], "runs": runs_for(sh)} for sh in a.shape},
                          "timed_steps": {case_key(sh, v): steps_for(sh, v) for sh, v in cases},
                          "patch": a.patch, "cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "started": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_start": list(os.getloadavg())},
               "cases": {}}
    for shape, vocab in cases:
        key, n_steps = case_key(shape, vocab), steps_for(shape, vocab)
        runs: dict[str, list] = {v: [] for v in variants}
        for v in variants if a.warmup_process else []:
            print(f"[{key}] warm-up process {v}", flush=True)
            spawn(v, vocab, a.threads, a.timeout, a.patch, n_steps, shape)
        for i in range(runs_for(shape)):
            for v in variants if i % 2 == 0 else variants[::-1]:  # interleaved: load drifts hit all alike
                r = spawn(v, vocab, a.threads, a.timeout, a.patch, n_steps, shape)
                runs[v].append(r)
                tt = r["timed"]
                print(f"[{key}] run {i + 1}/{runs_for(shape)} {v}: step {tt['wall']['total']:.2f} s wall, "
                      f"{tt['cpu']['total']:.2f} s cpu, peak RSS {r['peak_rss_mb']:.0f} MiB, "
                      f"load {r['loadavg_before'][0]:.1f}", flush=True)
        res = {v: summarize(rs) for v, rs in runs.items()}
        if "trl" in res:
            res["ratios"] = {v: ratios(res[v], res["trl"]) for v in ("ours", "ours_patched") if v in res}
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
