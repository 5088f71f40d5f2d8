"""The GPU check: everything a GPU user judges us by, in one run of at most 8 minutes on one H100.

    python benchmarks/gpu_check.py            # CUDA; writes benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --parts step --budget 300    # one part, its own budget
    python benchmarks/gpu_check.py --smoke    # CPU, tiny shapes: checks every part's code path

Parts, in order of importance, each in its own process (a crash or an out-of-memory in one is recorded,
the rest still run); `--budget` seconds (default 480) bound the whole run: a part, or a side of the step
part, that would not fit is skipped and says so in the JSON:

    profile      our loss + backward at the qwen2.5-0.5b-gpu shape (16 prompts x 8 completions x 256 tokens,
                 the Qwen2.5-0.5B config, random init, bf16; random completion ids, no decode): seconds with
                 each GPU head kernel ("gpu", "triton", both the two-pass head), every timed loss + backward
                 under torch.cuda.set_sync_debug_mode("error") (what it catches is reported) and a dispatch
                 counter's `host_syncs`; a torch.profiler top 15; MFU against a bf16 matmul rate measured first
                 (`gpu_step.matmul_rate`, `gpu_step.forward_flops_per_token`); each kernel's log-probs and
                 gradients against float64, with the full softmax and under top-k / top-p's kept set (the
                 truncated path); a chunk-size sweep; the same with Liger's body kernels
    packing      the same shape with completions of 16-512 new tokens (uniform): loss + backward padded, padded
                 with each prompt once (share_prefix), packed (torch's flash varlen kernel), packed with
                 length_buckets=4 (`packing.gpu_part`): seconds, peak memory, MFU on the real tokens, the
                 packed log-probs against the padded ones
    quickstart   the README's quick start, its model moved to CUDA: rewards and clip fractions it prints
    step         the whole GRPO step side by side (`grpo_vs_trl.spawn`, one process per side, gradient
                 checkpointing off then on in it): ours (generation with the fast decode), TRL + Liger, ours +
                 Liger body (training forwards only: the decode keeps HF's modules), TRL (HF `generate`), ours
                 with LoRA r=16: seconds per phase and peak CUDA memory
    compile      regional compilation (`torch.compile` of each decoder layer) against eager, same batch; then a
                 stream of ragged packed batches through the compiled layers, static shapes with
                 length_buckets=4 against exact lengths with automatic dynamic shapes (`packed_stream`)
    generation   the fast decode's agreement with HF `generate` (tiny model, float32: identical ids, sampled
                 too) and tests/model/test_fast_decode.py on CUDA

The goals it is read against (docs/benchmarks.md#gpu): loss + backward at least as fast as TRL + Liger and
MFU >= 40% (on real tokens), peak memory at most TRL + Liger's (gradient checkpointing off and on), the whole
step >= 5x TRL + Liger's with the Liger body on, LoRA's peak below full fine-tuning's; packed faster than
padded at ragged lengths; the truncated path within the float64 bound. Without CUDA (and without --smoke) it says so and
exits 0.

On a GPU machine without internet, the packages beside torch / transformers / peft travel as wheels:
trl, datasets, dill, multiprocess, liger-kernel (pure Python, a few MB; see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results" / "gpu_check.json"
PARTS = ("profile", "packing", "quickstart", "step", "compile", "generation")  # in order of importance
PART_MIN_S = {"profile": 60, "packing": 45, "quickstart": 30, "step": 75, "compile": 60, "generation": 60}
STEP_SIDE_S = 60  # about one side of the step part (one process: build, then gradient checkpointing off and on)


# ----------------------------------------------------------------------------- parts (each in a child process)


def part_quickstart(device: str) -> dict:
    """The README's quick start with `.to(device)` added after the model loads; what it printed."""
    text = (ROOT / "README.md").read_text()
    code = text.split("## Quick start", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    load = "model = AutoModelForCausalLM.from_pretrained(TINY_CALC)"
    if load not in code:
        raise RuntimeError("the README quick start no longer loads its model with the line gpu_check expects")
    code = code.replace(load, f"{load}.to({device!r})")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("step ")]
    if p.returncode != 0:
        raise RuntimeError(f"quick start failed (rc {p.returncode}): {p.stderr[-2000:]}")
    return {"device": device, "seconds": time.perf_counter() - t0, "printed": lines}


def part_generation(device: str, smoke: bool, timeout: float) -> dict:
    """Throughput and agreement of the decode paths (`generation.py`), and the fast decode's tests on `device`."""
    script = str(HERE / "generation.py")
    # (the 0.5B shape's throughput is the step part's generate column: `generation.py --shape qwen2.5-0.5b`)
    runs = {"tiny_float32": ["--shape", "tiny", "--dtype", "float32", "--batches", "8", "128", "--new-tokens", "64"]}
    if smoke:
        runs = {"tiny_float32": ["--shape", "tiny", "--batches", "4", "--new-tokens", "8"]}
    out = {}
    for name, args in runs.items():
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_check_generation_{name}.json"
        p = subprocess.run([sys.executable, script, "--device", device, "--sides", "default", "fast", "--check",
                            "--json", str(path), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        out[name] = json.loads(path.read_text()) if p.returncode == 0 else {"error": p.stderr[-3000:]}
        print(p.stdout, flush=True)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/model/test_fast_decode.py",
                        *([] if smoke else ["-k", "cuda"])], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    out["tests"] = {"rc": p.returncode, "summary": p.stdout.strip().splitlines()[-1:] + p.stderr.splitlines()[-3:]}
    return out


def _gpu_shape(smoke: bool):
    import grpo_sides as sides

    sides.env()
    if smoke:
        sides.SHAPES["smoke"] = sides.Shape(2, 2, 8, "tiny", "tiny smoke shape")
        return "smoke", 512
    return "qwen2.5-0.5b-gpu", sides.QWEN25_05B["vocab_size"]


def _rollouts(smoke: bool, device: str):
    """(model, tok, grpo, prepared batch) at the check's shape: each prompt with `group` completions of exactly
    `new_tokens` random ids (the loss + backward's cost does not depend on what was sampled, and no decode runs)."""
    import grpo_sides as sides
    import torch

    from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
    from SimpleTorchLLMRL.trainer.grpo import GRPO

    shape, vocab = _gpu_shape(smoke)
    sides.configure(shape, device, "bfloat16")
    tok, model = sides.build(vocab)
    G, N = sides.RUN.shape.group, sides.RUN.shape.new_tokens
    grpo = GRPO(model, tok, beta=0.0, group_size=G, temperature=1.0, share_prefix=True)
    gen = torch.Generator().manual_seed(0)
    rollouts = []
    for g, prompt in enumerate(sides.prompts()):
        for _ in range(G):
            ids = torch.randint(0, vocab, (N,), generator=gen).tolist()
            logprobs = (-5.0 * torch.rand(N, generator=gen, dtype=torch.float64)).tolist()
            reply = Message("", MessageType.MODEL, token_ids=ids, logprobs=logprobs)
            rollouts.append(Rollout([Message(prompt), reply], metadata={"group_id": g}))
    rewards = torch.rand(len(rollouts), generator=gen)
    tb = grpo.prepare(rollouts, rewards)
    model.train()
    return model, tok, grpo, tb


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


SYNC_ERRORS: list[str] = []  # host syncs that `torch.cuda.set_sync_debug_mode("error")` caught in loss + backward
_WARM: set[int] = set()  # GRPO objects whose first loss + backward (the once-per-model checks) ran


def _loss_backward(model, grpo, tb, device: str) -> float:
    """Seconds of one loss + backward; on CUDA under `set_sync_debug_mode("error")`: a host sync between the
    forward's start and the backward's end is recorded in SYNC_ERRORS (and the step rerun without the check)."""
    import torch

    _sync(device)
    t0 = time.perf_counter()
    if device == "cuda" and id(grpo) in _WARM:  # a model's first step runs its once-per-model checks (they sync)
        torch.cuda.set_sync_debug_mode("error")
        try:
            grpo.calculate_loss(tb).backward()
        except RuntimeError as e:
            SYNC_ERRORS.append(f"{e}"[-1000:])
            torch.cuda.set_sync_debug_mode("default")
            model.zero_grad(set_to_none=True)
            grpo.calculate_loss(tb).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        grpo.calculate_loss(tb).backward()
        _WARM.add(id(grpo))
    _sync(device)
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds


def host_syncs(model, grpo, tb) -> dict:
    """Ops of one loss + backward that wait for the device, counted by a TorchDispatchMode (any device)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    waits = {"_local_scalar_dense", "item", "nonzero", "allclose", "equal", "is_nonzero", "masked_select"}

    class Count(TorchDispatchMode):
        ops, syncs = 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            if func.overloadpacket.__name__ in waits:
                Count.syncs.append(str(func))
            return func(*args, **(kwargs or {}))

    with Count():
        grpo.calculate_loss(tb).backward()
    model.zero_grad(set_to_none=True)
    return {"ops": Count.ops, "syncs": len(Count.syncs), "sync_ops": sorted(set(Count.syncs)),
            "cuda_sync_debug_errors": list(SYNC_ERRORS)}


def _times(model, grpo, tb, device: str, n: int) -> list[float]:
    return [_loss_backward(model, grpo, tb, device) for _ in range(n)]  # the first one warms up


def _head_impls(device: str) -> list[str]:
    from SimpleTorchLLMRL.model.scoring import head_triton

    triton_ok = head_triton.available() and (device == "cuda" or head_triton.interpreting())
    return ["gpu"] + (["triton"] if triton_ok else [])


def part_profile(device: str, smoke: bool) -> dict:
    """Our loss + backward at the check's shape: each GPU head kernel, a torch.profiler table of the default,
    and the same with Liger's body kernels (`model.scoring.liger`); MFU of each; head numerics against float64."""
    import grpo_sides as sides
    import torch
    from gpu_numerics import head_numerics
    from gpu_step import forward_flops_per_token, matmul_rate
    from torch.profiler import ProfilerActivity, profile

    from SimpleTorchLLMRL.model.scoring import head_kernels as K

    peak = matmul_rate(torch.device(device), torch.bfloat16, n=256 if smoke else 8192, iters=2 if smoke else 20)
    model, _, grpo, tb = _rollouts(smoke, device)
    impls = _head_impls(device)
    numerics = head_numerics(model, tb, impls=["cpu", *impls])
    by_impl = {}
    for impl in impls:
        grpo.compute_options.head_impl = impl
        by_impl[impl] = _times(model, grpo, tb, device, 3)
    grpo.compute_options.head_impl = impls[-1]  # the one "auto" takes on CUDA
    syncs = host_syncs(model, grpo, tb)  # 0 expected (tests/trainer/test_host_syncs.py); CUDA also checks every timed step
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        _loss_backward(model, grpo, tb, device)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr, 0), reverse=True)
    top = [{"name": e.key, "calls": e.count, "self_cuda_ms": getattr(e, "self_device_time_total", 0) / 1e3,
            "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in events[:15]]
    B, T = tb.batch.input_ids.shape
    new = sides.RUN.shape.new_tokens
    prompt = T - new
    cfg = dict(sides.QWEN25_05B) if not smoke else {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512,
                                                     "intermediate_size": 128, "num_attention_heads": 4,
                                                     "num_key_value_heads": 2}
    tokens_run = B * new + (B // sides.RUN.shape.group) * prompt  # shared prompts run once per group
    flops = 3 * forward_flops_per_token(cfg, T / 2) * tokens_run
    seconds = min(by_impl[impls[-1]][1:])
    out = {"device": device, "seq_shape": [B, T], "tokens_run": tokens_run, "head_impl": impls[-1],
           "loss_backward_s": by_impl[impls[-1]], "loss_backward_s_by_head_impl": by_impl,
           "float32_output_gemm": K._F32_OUT["ok"], "numerics": numerics, "host_syncs": syncs,
           "measured_bf16_matmul_tflops": peak / 1e12, "model_tflops": flops / 1e12,
           "mfu_loss_backward": flops / seconds / peak,
           "self_cpu_ms_total": sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3,
           "self_cuda_ms_total": sum(e.self_device_time_total for e in prof.key_averages()  # kernels only
                                     if str(getattr(e, "device_type", "")).endswith("CUDA")) / 1e3,
           "top15": top, "table": prof.key_averages().table(sort_by=key, row_limit=15)}
    if device == "cuda":
        out["triton_chunk_bytes"] = _chunk_sweep(model, grpo, tb, device)
        out["liger_body"] = _with_liger_body(model, grpo, tb, device, flops, peak)
        out["cuda_sync_debug_errors"] = list(SYNC_ERRORS)  # every timed loss + backward ran under "error"
    return out


def _chunk_sweep(model, grpo, tb, device: str) -> dict:
    """The "triton" kernel's chunk size (MiB of float32 logits): seconds and peak memory of loss + backward."""
    import torch

    from SimpleTorchLLMRL.model.scoring import logprobs as L

    default, out = L.GPU_CHUNK_BYTES, {}
    grpo.compute_options.head_impl = "triton"
    try:
        for mib in (128, 256, 512, 1024):
            L.GPU_CHUNK_BYTES = mib * 2**20
            _loss_backward(model, grpo, tb, device)
            torch.cuda.reset_peak_memory_stats()
            seconds = min(_times(model, grpo, tb, device, 2))
            out[str(mib)] = {"loss_backward_s": seconds, "peak_mib": torch.cuda.max_memory_allocated() / 2**20}
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"[-2000:]
    finally:
        L.GPU_CHUNK_BYTES = default
    return out


def _with_liger_body(model, grpo, tb, device: str, flops: float, peak: float) -> dict:
    """Liger's RMSNorm / SwiGLU / RoPE in the body, our head: log-probs against the HF body's, seconds, MFU."""
    import torch

    from SimpleTorchLLMRL.model.scoring.liger import apply_liger_kernels
    from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs

    try:
        with torch.no_grad():
            before = token_logprobs(model, tb.batch, positions=tb.mask)
            apply_liger_kernels(model)
            after = token_logprobs(model, tb.batch, positions=tb.mask)
        times = _times(model, grpo, tb, device, 3)
    except Exception as e:  # noqa: BLE001  (recorded: the rest of the check still runs)
        return {"error": f"{type(e).__name__}: {e}"[-2000:]}
    sel = tb.mask.bool()
    return {"loss_backward_s": times, "mfu_loss_backward": flops / min(times[1:]) / peak,
            "logp_max_abs_vs_hf_body": float((after - before)[sel].abs().max()),
            "logp_mean_abs_vs_hf_body": float((after - before)[sel].abs().mean())}


def part_packing(device: str, smoke: bool) -> dict:
    """Packed against padded loss + backward with ragged completions (`packing.gpu_part`)."""
    import packing

    return packing.gpu_part(device, smoke)


def part_compile(device: str, smoke: bool) -> dict:
    """Regional compilation: each decoder layer `torch.compile`d (one graph serves all layers), our loss +
    backward against eager in the same process and batch; the first compiled step (the compile) is reported."""
    import torch

    from SimpleTorchLLMRL.model.scoring.logprobs import token_logprobs

    model, _, grpo, tb = _rollouts(smoke, device)
    eager = _times(model, grpo, tb, device, 3)
    with torch.no_grad():
        before = token_logprobs(model, tb.batch, positions=tb.mask)
    layers = model.model.layers
    t0 = time.perf_counter()
    for layer in layers:
        layer.compile(dynamic=False)
    compiled = _times(model, grpo, tb, device, 4)
    with torch.no_grad():
        after = token_logprobs(model, tb.batch, positions=tb.mask)
    sel = tb.mask.bool()
    out = {"layers": len(layers), "eager_loss_backward_s": eager, "compiled_loss_backward_s": compiled,
           "first_compiled_step_s": compiled[0], "compile_wall_s": time.perf_counter() - t0 - sum(compiled[1:]),
           "speedup": min(eager[1:]) / min(compiled[1:]),
           "logp_max_abs_vs_eager": float((after - before)[sel].abs().max()),
           "cuda_sync_debug_errors": list(SYNC_ERRORS)}
    out["packed_stream"] = packed_stream(model, device, smoke)
    return out


def packed_stream(model, device: str, smoke: bool) -> dict:
    """Ragged packed batches (16-512 new tokens) through the compiled layers: with length_buckets=4 (compiled
    for static shapes) and with exact lengths (compiled with automatic dynamic shapes): distinct shapes, dynamo's
    compiles, each step's seconds (a compile shows), the eager steps' for comparison."""
    import grpo_sides as sides
    import packing

    tok, _ = sides.build(512 if smoke else sides.QWEN25_05B["vocab_size"])
    rows, steps, (lo, hi) = (4, 3, (4, 24)) if smoke else (32, 5, (16, 512))
    out = {}
    try:
        batches = packing.ragged_batches(rows, steps, lo, hi, model.config.vocab_size, group=8 if not smoke else 2)
        for layer in model.model.layers:
            layer._compiled_call_impl = None
        out["eager"] = packing.stream(model, tok, batches, None, device)
        for name, buckets, dynamic in (("buckets_4_static", 4, False), ("exact_dynamic", None, None)):
            for layer in model.model.layers:
                layer.compile(dynamic=dynamic)
            out[name] = packing.stream(model, tok, batches, buckets, device)
    except Exception as e:  # noqa: BLE001  (recorded: the rest of the part stands)
        out["error"] = f"{type(e).__name__}: {e}"[-2000:]
    return out


# ----------------------------------------------------------------------------- parent


def run_child(args: list[str], timeout: float) -> dict:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"error": f"rc {p.returncode}: {(p.stderr or p.stdout)[-3000:]}"}
    return json.loads(lines[-1][len("RESULT "):])


STEP_SIDES = ("ours", "trl_liger", "ours_liger", "trl", "ours_lora")  # in order of importance
SMOKE_SIDES = ("ours", "trl", "ours_lora")


def part_step(device: str, smoke: bool, timeout: float, out: dict, save, left, only=None) -> dict:
    """The whole GRPO step side by side (`grpo_vs_trl.spawn`), one process per side, gradient checkpointing
    off then on in that process; fills `out` and calls save() after each side (a run cut short keeps what it
    measured). Ours generates with the fast decode ("auto" on CUDA), TRL with HF `generate`."""
    import grpo_sides as sides
    import grpo_vs_trl as bench

    shape = "tiny" if smoke else "qwen2.5-0.5b-gpu"
    vocab = 512 if smoke else sides.QWEN25_05B["vocab_size"]
    for side in only or (SMOKE_SIDES if smoke else STEP_SIDES):
        if left() < STEP_SIDE_S:
            out[side] = {"skipped": f"{left():.0f} s of the budget left, a side needs about {STEP_SIDE_S} s"}
            continue
        t0 = time.perf_counter()
        try:
            r = bench.spawn(side, vocab, 1, min(timeout, left()), timed_steps=1, shape=shape, device=device,
                            dtype="bfloat16", gc_both=True)
            out[side] = {gc: _side(run) for gc, run in (("gc_off", r), ("gc_on", r["gradient_checkpointing_on"]))}
            out[side].update(seq_shape=r["steps"][-1].get("seq_shape"), trl=r.get("trl"), wall_s=r["wall_s"],
                             peak_rss_mib=r["peak_rss_mb"])
        except Exception as e:  # noqa: BLE001  (recorded; the other sides still run)
            out[side] = {"error": str(e)[-3000:]}
        shown = {k: _brief(v) for k, v in out[side].items() if k in ("gc_off", "gc_on", "error")}
        print(f"[step] {side}: {shown} ({time.perf_counter() - t0:.0f} s)", flush=True)
        save()
    return out


def _side(run: dict) -> dict:
    return {"timed_wall_s": run["timed"]["wall"], "peak_cuda_mib": run.get("run_peak_cuda_mb"),
            "trained_tokens": run["steps"][-1].get("trained_tokens")}


def _brief(r) -> str:
    if isinstance(r, str):  # an error's text
        return "ERROR " + r.strip().splitlines()[-1][:200]
    t = r["timed_wall_s"]
    mem = "" if r["peak_cuda_mib"] is None else f", peak {r['peak_cuda_mib']:.0f} MiB"
    return f"generate {t['generate']:.2f} s, loss+backward {t['loss_backward']:.3f} s, step {t['total']:.2f} s{mem}"


def goals(res: dict) -> dict:
    """The issue's goals, read off this run (left out where a part failed). Against TRL + Liger: loss +
    backward speed (>= 1), peak memory (<= 1), the whole step's speed (>= 5 with the Liger body; ours with the
    fast decode, TRL with HF `generate`), gradient checkpointing off and on; `_liger_body`: ours with Liger's
    body kernels. Packed against padded at ragged lengths, MFU on real tokens; the truncated path's error."""
    g = {}
    sides = res.get("step", {})
    for ours_key, suffix in (("ours", ""), ("ours_liger", "_liger_body")):
        for gc in ("gc_off", "gc_on"):
            try:
                ours, liger = sides[ours_key][gc], sides["trl_liger"][gc]
                g[f"loss_backward_speed_vs_trl_liger_{gc}{suffix}"] = (liger["timed_wall_s"]["loss_backward"]
                                                                       / ours["timed_wall_s"]["loss_backward"])
                g[f"step_speed_vs_trl_liger_{gc}{suffix}"] = liger["timed_wall_s"]["total"] / ours["timed_wall_s"]["total"]
                g[f"peak_memory_vs_trl_liger_{gc}{suffix}"] = ours["peak_cuda_mib"] / liger["peak_cuda_mib"]
            except (KeyError, TypeError):
                pass
    for gc in ("gc_off", "gc_on"):
        try:
            g[f"lora_peak_vs_full_{gc}"] = sides["ours_lora"][gc]["peak_cuda_mib"] / sides["ours"][gc]["peak_cuda_mib"]
        except (KeyError, TypeError):
            pass
    prof = res.get("profile", {})
    if "mfu_loss_backward" in prof:
        g["mfu_loss_backward"] = prof["mfu_loss_backward"]
    if "mfu_loss_backward" in prof.get("liger_body", {}):
        g["mfu_loss_backward_liger_body"] = prof["liger_body"]["mfu_loss_backward"]
    if "speedup" in res.get("compile", {}):
        g["regional_compile_loss_backward_speedup"] = res["compile"]["speedup"]
    pack = res.get("packing", {})
    for name in ("packed", "packed_b4", "padded_shared"):
        if "speedup_vs_padded" in pack.get(name, {}):
            g[f"{name}_loss_backward_speedup_vs_padded"] = pack[name]["speedup_vs_padded"]
            g[f"{name}_mfu_real_tokens"] = pack[name]["mfu_real_tokens"]
    for impl in ("triton", "gpu"):
        trunc = prof.get("numerics", {}).get(f"{impl}_truncated", {})
        if "logp_max_abs" in trunc:
            g[f"{impl}_truncated_logp_max_abs_vs_float64"] = trunc["logp_max_abs"]
            break
    return g


def _commit() -> str | None:
    """The commit measured: GPU_CHECK_COMMIT (a copy of the tree without .git), else git's HEAD."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return p.stdout.strip() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: check every part's code path")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--out", type=Path, default=None, help=f"results JSON (default {RESULTS}; --smoke: not written)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per child process")
    ap.add_argument("--budget", type=float, default=480,
                    help="seconds for the whole check: a part (or a step side) that would not fit is skipped")
    ap.add_argument("--sides", nargs="+", choices=STEP_SIDES, help="the step part's sides (default: all)")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # internal: run one part in this process
    a = ap.parse_args()

    import torch

    device = "cpu" if a.smoke else "cuda"
    if a.part:
        fn = {"quickstart": lambda: part_quickstart(device), "profile": lambda: part_profile(device, a.smoke),
              "compile": lambda: part_compile(device, a.smoke), "packing": lambda: part_packing(device, a.smoke)}[a.part]
        print("RESULT " + json.dumps(fn()), flush=True)
        return
    if not a.smoke and not torch.cuda.is_available():
        print("gpu_check.py: CUDA is not available on this machine, nothing was measured "
              "(pass --smoke to check the code paths on CPU)")
        return
    smoke = ["--smoke"] if a.smoke else []
    res = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": _commit(), "device": device,
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
           "budget_s": a.budget}
    out = a.out or (None if a.smoke else RESULTS)
    t_all = time.perf_counter()

    def left() -> float:
        return a.budget - (time.perf_counter() - t_all)

    def save() -> None:
        res["seconds"] = time.perf_counter() - t_all
        res["goals"] = goals(res)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(res, indent=1))

    for part in a.parts:
        t0 = time.perf_counter()
        if left() < PART_MIN_S[part]:
            res[part] = {"skipped": f"{left():.0f} s of the budget left, the part needs about {PART_MIN_S[part]} s"}
        elif part == "generation":
            res[part] = part_generation(device, a.smoke, min(a.timeout, left()))
        elif part == "step":
            triton = res.get("profile", {}).get("numerics", {}).get("triton", {})
            if "error" in triton:  # our side falls back to the "gpu" head kernel rather than failing
                os.environ["GRPO_SIDES_HEAD_IMPL"] = res["step_head_impl"] = "gpu"
            res[part] = {}
            part_step(device, a.smoke, a.timeout, res[part], save, left, a.sides)
        else:
            res[part] = run_child([*smoke, "--part", part], min(a.timeout, left()))
        shown = {k: v for k, v in res[part].items() if k not in ("table", "top15")}
        print(f"[{part}] {time.perf_counter() - t0:.0f} s: {json.dumps(shown)[:1500]}", flush=True)
        if part == "profile" and "table" in res[part]:
            print(res[part]["table"], flush=True)
        save()
    print("goals: " + json.dumps(res["goals"]), flush=True)
    if out is not None:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
