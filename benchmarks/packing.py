"""Padding-free batches against padded ones: GRPO's loss + backward on ragged completions, and what bucketing and
regional compilation cost and give (CPU; `gpu_check.py` runs the same on a GPU).

Legend: B rows, P prompt tokens, N new tokens, T padded length, L packed length.

Each case builds B rollouts (a ~P-token prompt, then N random completion ids with sampled log-probs, one group)
and prepares them once per variant (`GRPO(packed=False)`, `GRPO(packed=True)`, and with `--buckets k` packed
with `length_buckets=k`); one untimed loss + backward each, then --repeats timed ones, interleaved (padded,
packed, ... each round) so that load on a shared machine hits all alike. Reported: CPU seconds (`process_time`,
--threads torch threads; the median), the token slots the body runs (padded B x T, packed L, the real
tokens), the speedup and the largest loss difference between the variants.

Cases: `spread` (N uniform in [--lo, --hi], the RL case; `--even`: evenly spaced from --lo to --hi), `equal`
(every row N = --hi), and the shapes:

    qwen2.5-0.5b   grpo_vs_trl.py's Qwen2.5-0.5B config (24 layers, hidden 896, 14/2 heads, V = 151,936),
                   random init, float32; rows sized for a 2-core CPU (docs/benchmarks.md: 4 and 2 rows)
    tiny           grpo_vs_trl.py's tiny Qwen2 (2 layers, hidden 64, V = 151,936): the head dominates

    uv run python benchmarks/packing.py --shape qwen2.5-0.5b --rows 4 --even --repeats 1 --cases spread --threads 2
    uv run python benchmarks/packing.py --shape qwen2.5-0.5b --rows 2 --repeats 1 --cases equal --threads 2
    uv run python benchmarks/packing.py --shape tiny --rows 16 --even --repeats 3
    uv run python benchmarks/packing.py --compile-stream 12 --shape small   # regional torch.compile, CPU

`--compile-stream S`: S ragged batches (fresh N each) through `GRPO(packed=True)` with each decoder layer
`torch.compile`d, with and without `--buckets`; reported: the distinct (packed length, longest row) pairs,
the compiles (dynamo's frame counts), each step's seconds (a compile shows) against eager.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {  # (layers, hidden, intermediate, heads, kv heads, vocab)
    "qwen2.5-0.5b": (24, 896, 4864, 14, 2, 151_936),
    "small": (4, 256, 1024, 4, 2, 4096),
    "tiny": (2, 64, 128, 4, 2, 151_936),
}


def build(shape: str, layers: int | None):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from SimpleTorchLLMRL.testing.tiny import tiny_tokenizer

    layers_, hidden, inter, heads, kv, V = SHAPES[shape]
    tok = tiny_tokenizer("chatml")
    config = Qwen2Config(vocab_size=V, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers or layers_,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32_768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, attn_implementation="sdpa")
    torch.manual_seed(0)
    return tok, AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def rollouts(rows: int, lengths: list[int], vocab: int, seed: int, question: int = 0):
    """`rows` rollouts of one prompt (a group), completion i of lengths[i] random ids with sampled log-probs."""
    import torch

    from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout

    gen = torch.Generator().manual_seed(seed)
    prompt = f"What is {question + 12} + {3 * question + 35}? Think step by step, then answer in \\boxed{{}}."
    out = []
    for n in lengths[:rows]:
        ids = torch.randint(0, min(vocab, 500), (n,), generator=gen).tolist()
        logprobs = (-5.0 * torch.rand(n, generator=gen, dtype=torch.float64)).tolist()
        out.append(Rollout([Message(prompt), Message("", MessageType.MODEL, token_ids=ids, logprobs=logprobs)],
                           metadata={"group_id": 0}))
    return out


def lengths_for(case: str, rows: int, lo: int, hi: int, seed: int, even: bool = False) -> list[int]:
    """New tokens per row: all `hi` (equal), uniform draws in [lo, hi], or (`even`) evenly spaced from lo to hi,
    the uniform's mean and maximum at any row count (a few random draws on a CPU are far from both)."""
    import random

    if case == "equal":
        return [hi] * rows
    if even:
        return [round(lo + (hi - lo) * i / max(rows - 1, 1)) for i in range(rows)]
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(rows)]


def _step(grpo, tb) -> tuple[float, float]:
    import time as t

    c0 = t.process_time()
    loss = grpo.calculate_loss(tb)
    loss.backward()
    seconds = t.process_time() - c0
    grpo.model.zero_grad(set_to_none=True)
    return seconds, float(loss.detach())


def run_case(model, tok, case: str, a) -> dict:
    from SimpleTorchLLMRL.trainer.grpo import GRPO

    lengths = lengths_for(case, a.rows, a.lo, a.hi, a.seed, a.even)
    batch = rollouts(a.rows, lengths, model.config.vocab_size, a.seed)
    variants = {"padded": dict(packed=False), "packed": dict(packed=True)}
    if a.buckets:
        variants[f"packed_b{a.buckets}"] = dict(packed=True, length_buckets=a.buckets)
    sides = {}
    for name, opts in variants.items():
        grpo = GRPO(model, tok, group_size=a.rows, temperature=1.0, **opts)
        tb = grpo.prepare(batch, [float(i % 2) for i in range(a.rows)])
        B, T = tb.input_ids.shape
        plan = tb.pack_plan
        sides[name] = {"grpo": grpo, "tb": tb, "slots": B * T if plan is None else plan.length,
                       "layout": [B, T] if plan is None else [1, plan.length],
                       "times": [], "loss": _step(grpo, tb)[1]}  # warm-up
    for _ in range(a.repeats):
        for side in sides.values():
            side["times"].append(_step(side["grpo"], side["tb"])[0])
    tb = sides["padded"]["tb"]
    real = int(tb.batch.attention_mask.sum())
    out = {"case": case, "rows": a.rows, "new_tokens": lengths, "real_tokens": real,
           "trained_tokens": int(tb.mask.sum())}
    for name, side in sides.items():
        out[name] = {"cpu_s": statistics.median(side["times"]), "all_cpu_s": side["times"], "slots": side["slots"],
                     "layout": side["layout"], "loss": side["loss"]}
    out["speedup"] = {name: out["padded"]["cpu_s"] / out[name]["cpu_s"] for name in variants if name != "padded"}
    out["max_loss_diff"] = max(abs(out[n]["loss"] - out["padded"]["loss"]) for n in variants)
    return out


def ragged_batches(rows: int, steps: int, lo: int, hi: int, vocab: int, group: int, seed: int = 0) -> list[list]:
    """`steps` batches of `rows` rollouts in groups of `group` (a prompt each), new tokens uniform in [lo, hi]."""
    import random

    rng = random.Random(seed)
    out = []
    for s in range(steps):
        batch = []
        for g in range(rows // group):
            for r in rollouts(group, [rng.randint(lo, hi) for _ in range(group)], vocab, seed * 1000 + s * 100 + g,
                              question=g):
                r.metadata["group_id"] = g
                batch.append(r)
        out.append(batch)
    return out


def stream(model, tok, batches: list[list], buckets: int | None, device: str = "cpu") -> dict:
    """Each batch through `GRPO(packed=True, length_buckets=buckets)`: its (packed length, longest row), seconds of
    loss + backward (wall; CPU time too on CPU), and dynamo's counts (the compiles) after dynamo is reset."""
    import torch

    from SimpleTorchLLMRL.trainer.grpo import GRPO

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    group = sum(1 for r in batches[0] if r.metadata["group_id"] == 0)
    grpo = GRPO(model, tok, group_size=group, temperature=1.0, packed=True, length_buckets=buckets)
    shapes, wall, cpu, errors = [], [], [], []
    for b in batches:
        tb = grpo.prepare(b, [float(i % 2) for i in range(len(b))])
        shapes.append([tb.pack_plan.length, tb.pack_plan.rows.max_seqlen])
        c0 = time.process_time()
        wall.append(_timed(grpo, tb, device, errors))
        cpu.append(time.process_time() - c0)
    counters = torch._dynamo.utils.counters
    return {"shapes": shapes, "distinct_shapes": len({tuple(x) for x in shapes}), "wall_s": wall, "cpu_s": cpu,
            "dynamo_frames": dict(counters["frames"]), "recompiles": dict(counters["recompiles"]),
            "cuda_sync_debug_errors": errors}


def compile_stream(model, tok, a) -> dict:
    """The CLI's --compile-stream: eager, then each decoder layer compiled (static shapes), exact and bucketed."""
    batches = ragged_batches(a.rows, a.compile_stream, a.lo, a.hi, model.config.vocab_size, a.rows, a.seed)
    out = {"eager": stream(model, tok, batches, None)}
    for layer in model.model.layers:
        layer.compile(dynamic=False)
    for buckets in (None, a.buckets or 4):
        out[f"buckets_{buckets}"] = stream(model, tok, batches, buckets)
    for layer in model.model.layers:  # back to eager for whatever runs next
        layer._compiled_call_impl = None
    return out


# ----------------------------------------------------------------------------- gpu_check.py's "packing" part


def _timed(grpo, tb, device: str, errors: list) -> float:
    """Seconds of one loss + backward; on CUDA under set_sync_debug_mode("error") (a sync is recorded in `errors`,
    the step rerun without the check)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    try:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        grpo.calculate_loss(tb).backward()
    except RuntimeError as e:
        errors.append(f"{e}"[-1000:])
        torch.cuda.set_sync_debug_mode("default")
        grpo.model.zero_grad(set_to_none=True)
        grpo.calculate_loss(tb).backward()
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    sync()
    seconds = time.perf_counter() - t0
    grpo.model.zero_grad(set_to_none=True)
    return seconds


def gpu_part(device: str, smoke: bool, repeats: int = 3) -> dict:
    """Packed against padded loss + backward at the GPU check's shape (16 prompts x 8 completions, the Qwen2.5-0.5B
    config, bf16) with completions of 16-512 new tokens (uniform): seconds, peak memory, MFU on the real tokens,
    the packed log-probs against the padded ones; variants padded (as TRL), padded with each prompt once
    (`share_prefix`, what the step part's "ours" runs), packed, packed with length_buckets=4."""
    import grpo_sides as sides
    import torch
    from gpu_step import forward_flops_per_token, matmul_rate

    from SimpleTorchLLMRL.trainer.grpo import GRPO

    shape, (lo, hi) = ("tiny", (4, 24)) if smoke else ("qwen2.5-0.5b-gpu", (16, 512))
    sides.env()
    sides.configure(shape, device, "bfloat16")
    vocab = 512 if smoke else sides.QWEN25_05B["vocab_size"]
    tok, model = sides.build(vocab)
    model.train()
    U, G = (2, 4) if smoke else (sides.RUN.shape.prompts, sides.RUN.shape.group)
    gen = torch.Generator().manual_seed(0)
    batch = []
    for g in range(U):
        lengths = [int(n) for n in torch.randint(lo, hi + 1, (G,), generator=gen)]
        for r in rollouts(G, lengths, vocab, seed=g, question=g):
            r.metadata["group_id"] = g
            batch.append(r)
    rewards = torch.rand(len(batch), generator=gen)
    variants = {"padded": dict(packed=False), "padded_shared": dict(packed=False, share_prefix=True),
                "packed": dict(packed=True), "packed_b4": dict(packed=True, length_buckets=4)}
    errors: list[str] = []
    out, runs = {"device": device, "rows": len(batch), "new_tokens": [lo, hi]}, {}
    for name, opts in variants.items():
        grpo = GRPO(model, tok, beta=0.0, group_size=G, temperature=1.0, **opts)
        tb = grpo.prepare(batch, rewards)
        first = grpo.compute(tb)  # the once-per-model checks; the log-probs compared below
        first.loss.backward()
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _timed(grpo, tb, device, errors)
        runs[name] = (grpo, tb, first.token_logprobs)
        out[name] = {"peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
                     "slots": tb.pack_plan.length if tb.pack_plan is not None else int(tb.input_ids.numel()),
                     "seconds": []}
    for _ in range(repeats):  # interleaved
        for name, (grpo, tb, _) in runs.items():
            out[name]["seconds"].append(_timed(grpo, tb, device, errors))
    tb = runs["padded"][1]
    real, trained = int(tb.batch.attention_mask.sum()), tb.mask.bool()
    cfg = dict(sides.QWEN25_05B) if not smoke else {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512,
                                                     "intermediate_size": 128, "num_attention_heads": 4,
                                                     "num_key_value_heads": 2}
    flops = 3 * forward_flops_per_token(cfg, real / len(batch) / 2) * real  # counted on real tokens
    peak = matmul_rate(torch.device(device), torch.bfloat16, n=256 if smoke else 8192, iters=2 if smoke else 20)
    base = runs["padded"][2]
    for name in variants:
        best = min(out[name]["seconds"])
        out[name].update(best_s=best, mfu_real_tokens=flops / best / peak,
                         speedup_vs_padded=min(out["padded"]["seconds"]) / best,
                         logp_max_abs_vs_padded=float((runs[name][2] - base)[trained].abs().max()))
    out.update(real_tokens=real, trained_tokens=int(trained.sum()), cuda_sync_debug_errors=errors,
               measured_bf16_matmul_tflops=peak / 1e12)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--lo", type=int, default=16, help="fewest new tokens of the spread case")
    ap.add_argument("--hi", type=int, default=512, help="most new tokens (every row's in the equal case)")
    ap.add_argument("--even", action="store_true", help="spread: new tokens evenly spaced from --lo to --hi")
    ap.add_argument("--cases", nargs="+", choices=("spread", "equal"), default=["spread", "equal"])
    ap.add_argument("--buckets", type=int, default=None, help="also packed with length_buckets=k")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-stream", type=int, default=0, help="S ragged batches through compiled layers")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    tok, model = build(a.shape, a.layers)
    res = {"shape": a.shape, "layers": model.config.num_hidden_layers, "threads": a.threads,
           "torch": torch.__version__, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": []}
    if a.compile_stream:
        res["compile_stream"] = compile_stream(model, tok, a)
        print(json.dumps(res["compile_stream"], indent=1))
    else:
        print(f"{a.shape} ({res['layers']} layers), {a.rows} rows, float32, {a.threads} thread(s), CPU seconds of "
              f"loss + backward, median of {a.repeats} interleaved")
        print("| case | variant | layout | token slots (real) | CPU s | speedup |")
        print("|---|---|---|---:|---:|---:|")
        for case in a.cases:
            r = run_case(model, tok, case, a)
            res["cases"].append(r)
            for name in [k for k in r if k == "padded" or k.startswith("packed")]:
                v = r[name]
                speed = "1.00" if name == "padded" else f"{r['speedup'][name]:.2f}"
                print(f"| {case} | {name} | {' x '.join(map(str, v['layout']))} | {v['slots']:,} ({r['real_tokens']:,})"
                      f" | {v['cpu_s']:.2f} | {speed}x |", flush=True)
            print(f"  largest loss difference against padded: {r['max_loss_diff']:.1e}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
