"""The tools examples: examples/tool_use_grpo.py and examples/countdown.py.

Countdown's problems and reward against hand-computed values; each example's loop run
in-process with a scripted generator (known replies, so every logged metric has a known
value and the rewards differ within a group, so GRPO takes a real step); and both
scripts run as subprocesses with the default model (slow).
"""

import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from SimpleTorchLLMRL.tools import evaluate
from SimpleTorchLLMRL.utils.metrics import read_metrics
from tests.support.examples_helpers import load_example
from tests.support.scripted_agent import model_message

ROOT = Path(__file__).resolve().parents[2]


countdown = load_example("countdown")
tool_use_grpo = load_example("tool_use_grpo")

# ------------------------------------------------------------------ countdown problems and reward


def test_make_problem_targets_are_reachable_with_each_number_once():
    rng = random.Random(3)
    for _ in range(100):
        p = countdown.make_problem(rng, n_numbers=4)
        assert len(p["numbers"]) == 4 and all(1 <= n <= 30 for n in p["numbers"])
        assert isinstance(p["target"], int) and 1 <= p["target"] <= 100
        assert evaluate(p["solution"]) == pytest.approx(p["target"], abs=1e-9)
        assert countdown.countdown_score(f"\\boxed{{{p['solution']}}}", p) == 1.0
    a = [countdown.make_problem(random.Random(5)) for _ in range(2)]
    assert a[0] == a[1]  # seeded
    with pytest.raises(ValueError, match="n_numbers"):
        countdown.make_problem(rng, n_numbers=1)


P = {"numbers": [3, 5, 7], "target": 50}


@pytest.mark.parametrize("text, problem, expected", [
    ("So \\boxed{(3 + 7) * 5}", P, 1.0),
    ("\\boxed{5*(7+3)}.", P, 1.0),
    ("\\boxed{(28 + 17) / 9}", {"numbers": [9, 17, 28], "target": 5}, 1.0),  # true division
    ("\\boxed{26 / (26 / 27)}", {"numbers": [26, 26, 27], "target": 27}, 1.0),  # float rounding, repeated number
    ("\\boxed{3 * 5 + 7}", P, 0.1),  # 22: wrong value
    ("\\boxed{(3 + 7) * 5 * 1}", P, 0.1),  # an extra number
    ("\\boxed{(7 + 7) * 5}", P, 0.1),  # 7 twice, 3 unused
    ("\\boxed{50}", P, 0.1),  # the target, not an expression
    ("\\boxed{2 ** 3 + 5}", {"numbers": [2, 3, 5], "target": 13}, 0.1),  # ** is not allowed
    ("\\boxed{7 // 2 + 5}", {"numbers": [2, 5, 7], "target": 8}, 0.1),  # // is not allowed
    ("\\boxed{(3 + 7) * 5.0}", P, 0.1),  # decimals are not allowed
    ("\\boxed{(3 + 7) * x5}", P, 0.1),  # not arithmetic
    ("\\boxed{3 / (5 - 5) + 7}", {"numbers": [3, 5, 5, 7], "target": 50}, 0.1),  # division by zero
    ("(3 + 7) * 5", P, 0.0),  # no box
    ("\\boxed{}", P, 0.0),  # empty box
    ("\\boxed{(3 + 7) * 5", P, 0.0),  # unclosed box
])
def test_countdown_score_hand_computed(text, problem, expected):
    assert countdown.countdown_score(text, problem) == expected


# ------------------------------------------------------------------ the loops, with scripted replies


class Scripted:
    """A generator stand-in: member k of each group (in order of first sight) follows script k."""

    def __init__(self, scripts, tokenizer):
        self.scripts, self.tokenizer, self.member = scripts, tokenizer, {}

    def batch_rollout_generate_response(self, rollouts):
        for r in rollouts:
            k = self.member.setdefault(id(r), len(self.member) % len(self.scripts))
            turn = sum(m.role == "assistant" for m in r)
            r.add_messages(model_message(self.scripts[k](r, turn), self.tokenizer))


def _call(expression):
    return json.dumps({"name": "calculator", "arguments": {"expression": expression}}).join(
        ["<tool_call>", "</tool_call>"])


def _run_scripted(module, scripts, tmp_path, monkeypatch, steps=2):
    """Run `module.main` with the scripted generator; (metrics rows, the generator, parameters changed?)."""
    made, loaded = [], []

    def fake_generate(model, tokenizer, **kwargs):
        assert kwargs["tool_call_stop"] == ["</tool_call>"]
        made.append(Scripted(scripts, tokenizer))
        return made[-1]

    def loader(*args, real=module.load_model):
        out = real(*args)
        loaded.append((out[0], [p.detach().clone() for p in out[0].parameters()]))
        return out

    monkeypatch.setattr(module, "ModelGenerate", fake_generate)
    monkeypatch.setattr(module, "load_model", loader)
    module.main(["--steps", str(steps), "--batch-size", "2", "--group-size", "4", "--model", "random",
                 "--out", str(tmp_path)])
    model, before = loaded[0]
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return read_metrics(tmp_path / "metrics.jsonl"), made[0], changed


@pytest.mark.slow  # the first test to build a model pays transformers' model imports (~10-25 s here)
def test_tool_use_grpo_loop_logs_known_metrics_and_steps(tmp_path, monkeypatch):
    def solve_with_tool(r, turn):  # call the calculator on the question's expression, then box its result
        return _call(re.search(r"\d+ [-+*] \d+", r.metadata["question"]).group(0)) if turn == 0 else \
            f"\\boxed{{{r.messages[-1].content}}}"

    scripts = [solve_with_tool, lambda r, t: "\\boxed{0.5}"] * 2  # members 0, 2 right via the tool; 1, 3 wrong
    rows, _, changed = _run_scripted(tool_use_grpo, scripts, tmp_path, monkeypatch)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["reward/mean"] == pytest.approx((1.1 + 0.1) / 2)  # boxed 1.0 + format 0.1, or format only
        assert row["reward/boxed"] == 0.5 and row["reward/format"] == 1.0
        assert row["tool/call_rate"] == 0.5 and row["tool/calls"] == 0.5 and row["tool/errors"] == 0
        assert row["turns"] == 1.5 and row["truncated"] == 0 and row["frac_constant_groups"] == 0
        assert row["grad_norm"] > 0 and math.isfinite(row["loss"])
    assert changed  # the optimizer stepped


@pytest.mark.slow
def test_countdown_loop_logs_known_metrics_and_steps(tmp_path, monkeypatch):
    problems = {}
    real = countdown.make_problem

    def recording(*a):
        p = real(*a)
        problems[countdown.QUESTION.format(numbers=p["numbers"], target=p["target"])] = p
        return p

    monkeypatch.setattr(countdown, "make_problem", recording)
    sol = lambda r: problems[r.metadata["question"]]["solution"]  # noqa: E731
    scripts = [
        lambda r, t: _call(sol(r)) if t == 0 else f"\\boxed{{{sol(r)}}}",  # checks with the calculator: 1.0
        lambda r, t: f"\\boxed{{{problems[r.metadata['question']]['target']}}}",  # the target itself: 0.1
        lambda r, t: "I do not know.",  # no box: 0.0
        lambda r, t: f"So \\boxed{{{sol(r)}}}",  # solved directly: 1.0
    ]
    rows, gen, changed = _run_scripted(countdown, scripts, tmp_path, monkeypatch)
    assert len(gen.member) == 2 * 2 * 4  # 2 steps x 2 problems x 4 samples, each scripted
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["reward/mean"] == pytest.approx((1.0 + 0.1 + 0.0 + 1.0) / 4)
        assert row["solved"] == 0.5 and row["boxed"] == 0.75
        assert row["tool/call_rate"] == 0.25 and row["tool/calls"] == 0.25 and row["tool/errors"] == 0
        assert row["frac_constant_groups"] == 0 and row["grad_norm"] > 0 and math.isfinite(row["loss"])
    assert changed


# ------------------------------------------------------------------ the scripts, as a user runs them

KEYS = {
    "tool_use_grpo": {"reward/mean", "reward/boxed", "reward/format", "tool/call_rate", "tool/calls",
                      "tool/errors", "turns", "truncated", "loss", "grad_norm", "entropy", "seconds"},
    "countdown": {"reward/mean", "solved", "boxed", "tool/call_rate", "tool/calls", "tool/errors", "loss",
                  "grad_norm", "entropy", "seconds"},
}


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
    """Both scripts started at once (they mostly wait on imports), 2 steps each with the default model."""
    runs = {}
    for name in KEYS:
        out = tmp_path_factory.mktemp(name)
        cmd = [sys.executable, str(ROOT / "examples" / f"{name}.py"), "--steps", "2", "--batch-size", "1",
               "--group-size", "2", "--out", str(out)]
        runs[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
                      out)
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(KEYS))
def test_script_runs_and_writes_metrics(script_runs, name):
    proc, out = script_runs[name]
    stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout[-3000:]
    assert "[step 1]" in stdout and "[step 2]" in stdout and "done: 2 steps" in stdout, stdout[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert KEYS[name] <= set(row), sorted(row)
        assert 0.0 <= row["reward/mean"] <= 1.1 and 0.0 <= row["tool/call_rate"] <= 1.0
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
        if name == "countdown":  # every reward is 1.0, 0.1 or 0.0
            assert row["reward/mean"] == pytest.approx(row["solved"] + 0.1 * (row["boxed"] - row["solved"]))
        else:
            assert row["reward/mean"] == pytest.approx(row["reward/boxed"] + 0.1 * row["reward/format"])
    assert torch.isfinite(torch.tensor([r["entropy"] for r in rows])).all()
