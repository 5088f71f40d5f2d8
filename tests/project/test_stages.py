"""The suite's two stages (tests/support/stages.py): fast tests first, slow ones after; a fast failure ends the run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # stages.py

# Each test prints "@@ran:<name>"; the name is written apart so that a traceback quoting the line is no run.
TESTS = '''
import pytest

@pytest.mark.slow
def test_slow_defined_first():
    print("@@ran:" + "slow_defined_first")

@pytest.mark.vllm
def test_engine():
    print("@@ran:" + "engine")

def test_fast_a():
    print("@@ran:" + "fast_a")
    assert {ok}

@pytest.mark.distributed
def test_torchrun():
    print("@@ran:" + "torchrun")

def test_fast_b():
    print("@@ran:" + "fast_b")
'''


def run_suite(tmp_path: Path, ok: bool) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text("from stages import pytest_collection_modifyitems, pytest_runtest_protocol\n")
    (tmp_path / "test_toy.py").write_text(TESTS.format(ok=ok))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: s\n    vllm: v\n    distributed: d\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PYTHONPATH": str(SUPPORT), "PATH": "/usr/bin:/bin"})


def ran(out: str) -> list[str]:
    return re.findall(r"@@ran:(\w+)", out)


def test_the_fast_stage_runs_first_then_the_slow_one_in_file_order(tmp_path):
    run = run_suite(tmp_path, ok=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ran(run.stdout) == ["fast_a", "fast_b", "slow_defined_first", "engine", "torchrun"]


def test_a_failure_in_the_fast_stage_ends_the_run_before_the_slow_stage(tmp_path):
    run = run_suite(tmp_path, ok=False)
    assert run.returncode == 1, run.stdout + run.stderr
    assert ran(run.stdout) == ["fast_a", "fast_b"]
    assert "1 failed in the fast stage; the slow stage (slow, vllm, distributed) did not run" in run.stdout
