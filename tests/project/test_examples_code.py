"""examples/code_grpo.py: the loop on data set rows, with a scripted generator (a right and a wrong solution
in each group) and, as a user runs it, on the real HumanEval with the embedded model."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from SimpleTorchLLMRL.utils.metrics import read_metrics
from tests.support.examples_helpers import load_example
from tests.support.scripted_agent import model_message

ROOT = Path(__file__).resolve().parents[2]
code_grpo = load_example("code_grpo")

MBPP_ROWS = [  # MBPP's original schema
    {"task_id": 1, "text": "Write a function to add two numbers.", "code": "", "test_setup_code": "",
     "test_list": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"], "challenge_test_list": []},
    {"task_id": 2, "text": "Write a function to double a number.", "code": "", "test_setup_code": "",
     "test_list": ["assert double(4) == 8", "assert double(0) == 0"], "challenge_test_list": []},
]
RIGHT = {"add": "def add(a, b):\n    return a + b", "double": "def double(x):\n    return 2 * x"}


class Scripted:
    """Member 0 of each group writes the right solution, member 1 a wrong one."""

    def __init__(self, tokenizer):
        self.tokenizer, self.member = tokenizer, {}

    def batch_rollout_generate_response(self, rollouts):
        for r in rollouts:
            k = self.member.setdefault(id(r), len(self.member) % 2)
            name = "add" if "add two" in r.messages[-1].content else "double"
            code = RIGHT[name] if k == 0 else f"def {name}(*a):\n    return 0"
            r.add_messages(model_message(f"```python\n{code}\n```", self.tokenizer))


@pytest.mark.slow
def test_code_grpo_pays_the_right_member_of_each_group_and_steps(tmp_path, monkeypatch):
    data = tmp_path / "mbpp.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in MBPP_ROWS))
    loaded = []

    def loader(*args, real=code_grpo.load_model_or_tiny):
        out = real(*args)
        loaded.append((out[0], [p.detach().clone() for p in out[0].parameters()]))
        return out

    monkeypatch.setattr(code_grpo, "ModelGenerate", lambda model, tokenizer, **kw: Scripted(tokenizer))
    monkeypatch.setattr(code_grpo, "load_model_or_tiny", loader)
    code_grpo.main(["--dataset", str(data), "--format", "mbpp", "--steps", "2", "--batch-size", "2",
                    "--group-size", "2", "--model", "random", "--lr", "1e-3", "--out", str(tmp_path / "out")])
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["reward/mean"] == 0.5 and row["code/reward"] == 0.5
        assert row["code/tests_passed"] == 0.75  # the wrong "return 0" still passes add(-1, 1) and double(0)
        assert row["code/no_code"] == 0 and row["code/failed_runs"] == 0
        assert row["grad_norm"] > 0 and math.isfinite(row["loss"])
    model, before = loaded[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_row_of_no_known_shape_stops_the_example_naming_it(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "4"}) + "\n")
    with pytest.raises(SystemExit, match="row 1: code tests of an unknown shape"):
        code_grpo.load_tasks(str(data), "auto")


@pytest.mark.slow
def test_code_grpo_runs_as_a_user_runs_it(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "code_grpo.py"), "--steps", "2", "--batch-size",
                           "1", "--group-size", "2", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tasks (humaneval) fit the context" in proc.stdout and "done: 2 steps" in proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
