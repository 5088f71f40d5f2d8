"""The GPU benchmarks on a machine without CUDA: they say so and exit 0, and refuse what cannot run (no GPU needed)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
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
    assert p.returncode == 2 and "trl_liger needs --device cuda" in p.stderr
