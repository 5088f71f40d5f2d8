"""main.py end to end: a short run, SIGKILL + --resume == uninterrupted, bad input, and its helpers."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from SimpleTorchLLMRL.recipes.calculator.cli import DEFAULT_MODEL
from SimpleTorchLLMRL.recipes.calculator.data import DatasetError, check_rows, load_data, read_rows
from SimpleTorchLLMRL.recipes.calculator.evaluate import pass_at_k, summary_table
from SimpleTorchLLMRL.recipes.calculator.train_loop import batch_at, step_seed, trim_metrics
from SimpleTorchLLMRL.utils.metrics import read_metrics
from tests.support.fake_wandb import FakeWandb

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("MAIN_TEST_MODEL", DEFAULT_MODEL))  # the embedded model unless told otherwise
HAS_ASSET = (MODEL / "config.json").exists() and (MODEL / "model.safetensors").exists()
needs_asset = pytest.mark.skipif(not HAS_ASSET, reason=f"the embedded model is not built yet ({MODEL})")

# small enough for seconds per run on 2 busy cores, big enough that GRPO has non-zero advantages
SMALL = ["--model", str(MODEL), "--batch-size", "2", "--group-size", "4", "--eval-size", "6", "--pass-k", "2", "--pass-k-size", "3",
         "--max-new-tokens", "40", "--threads", "1"]
TIME_KEYS = ("train/gen_seconds", "train/step_seconds")


def load_main():
    spec = importlib.util.spec_from_file_location("main_under_test", ROOT / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, **kwargs)


def without_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in rows]


def sigterm_after_first_step(argv: list[str], out: Path, poll: float = 0.02) -> tuple[int, str]:
    """Run main.py with `argv`, send SIGTERM once a train row is logged in `out`; (exit code, stderr)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "main.py"), *argv, "--output-dir", str(out)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").exists() or '"train/reward"' not in (out / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.time() < deadline, "no training step logged"
            time.sleep(poll)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, proc.stderr.read()


# ---------------------------------------------------------------- helpers (fast)


def test_pass_at_k_matches_brute_force_enumeration():
    for n, k in [(1, 1), (4, 1), (4, 2), (5, 3), (6, 6)]:
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            subsets = list(itertools.combinations(outcomes, k))
            naive = sum(any(s) for s in subsets) / len(subsets)
            assert math.isclose(pass_at_k(n, c, k), naive, rel_tol=0, abs_tol=1e-12), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_batch_at_is_a_seeded_function_of_position_and_covers_each_epoch():
    rows = [{"question": str(i), "answer": str(i)} for i in range(10)]
    first = [r["question"] for r in batch_at(rows, 0, 10, seed=3)]
    assert sorted(first) == [str(i) for i in range(10)] and first != sorted(first)
    second = [r["question"] for r in batch_at(rows, 10, 10, seed=3)]
    assert sorted(second) == sorted(first) and second != first  # a new shuffle per epoch
    stitched = batch_at(rows, 0, 4, 3) + batch_at(rows, 4, 9, 3) + batch_at(rows, 13, 7, 3)
    assert [r["question"] for r in stitched] == first + second  # any split into batches sees the same order
    assert batch_at(rows, 0, 10, seed=4) != batch_at(rows, 0, 10, seed=3)


def test_step_seed_depends_on_step_and_stream_only():
    seeds = {step_seed(0, s, stream) for s in range(100) for stream in (0, 1)}
    assert len(seeds) == 200 and step_seed(0, 5) == step_seed(0, 5)


def test_synthetic_split_is_disjoint_and_file_split_holds_out(tmp_path):
    train, held = load_data(None, eval_size=50, seed=0)
    assert len(held) == 50 and not {r["question"] for r in held} & {r["question"] for r in train}
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": i, "extra": 1}) + "\n" for i in range(20)))
    train, held = load_data(str(path), eval_size=100, seed=0)
    assert len(held) == 4 and len(train) == 16  # at most a fifth of a small file is held out
    assert {r["question"] for r in train} | {r["question"] for r in held} == {f"q{i}" for i in range(20)}
    assert all(r["answer"] == r["question"][1:] for r in train)  # answers become strings


def test_read_rows_formats_and_errors(tmp_path):
    (tmp_path / "cols.json").write_text(json.dumps({"question": ["a", "b"], "answer": ["1", "2"]}))
    assert read_rows(str(tmp_path / "cols.json")) == [{"question": "a", "answer": "1"},
                                                      {"question": "b", "answer": "2"}]
    (tmp_path / "bad.jsonl").write_text('{"question": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(DatasetError, match="line 2"):
        read_rows(str(tmp_path / "bad.jsonl"))
    with pytest.raises(DatasetError, match="no such file"):
        read_rows(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DatasetError, match=r"\['answer'\]"):
        check_rows([{"question": "a", "answer": "1"}, {"question": "b"}], "x")


def test_trim_metrics_drops_rows_after_the_checkpoint_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "v": s}) + "\n" for s in [0, 1, 2, 3]) + '{"step": 4, "v"')
    trim_metrics(path, 2)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]


def test_summary_table_lists_every_evaluation():
    rows = [{"step": 0, "eval/accuracy": 0.1, "eval/pass@4": 0.5}, {"step": 1, "train/reward": 0.3},
            {"step": 5, "eval/accuracy": 0.75, "eval/pass@4": 0.875}]
    lines = summary_table(rows, 4).splitlines()
    assert lines[2].startswith("| 0 | 0.100 | 0.500 |") and lines[3].startswith("| 5 | 0.750 | 0.875 |")
    assert len(lines) == 4


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing written


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random-init Llama with the tiny ChatML tokenizer (bad-input cases never train it)."""
    from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_model")
    tok = tiny_tokenizer("chatml", padding_side="left")
    tiny_model("llama", tok, max_position_embeddings=2048).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _bad_input_cases(tmp: Path, model: Path):
    no_fields = tmp / "no_fields.jsonl"
    no_fields.write_text('{"prompt": "What is 1 + 1?", "solution": "2"}\n' * 5)
    unreadable = tmp / "unreadable.jsonl"
    unreadable.write_bytes(b"\xff\xfe\x00not json at all\n")
    a_file = tmp / "a_file"
    a_file.write_text("precious")
    return {
        "missing model": (["--model", str(tmp / "no_such_model")], "no such directory"),
        "unreadable dataset": (["--model", str(model), "--dataset", str(unreadable)], "--dataset"),
        "dataset without fields": (["--model", str(model), "--dataset", str(no_fields)], "'question'"),
        "steps 0": (["--model", str(model), "--steps", "0"], "--steps must be >= 1"),
        "negative staleness": (["--model", str(model), "--async-staleness", "-1"], "--async-staleness must be >= 0"),
        "output dir is a file": (["--model", str(model), "--output-dir", str(a_file)], "is a file"),
    }


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, tiny_model_dir, capfd):
    main = load_main()
    for name, (argv, expected) in _bad_input_cases(tmp_path, tiny_model_dir).items():
        out = tmp_path / f"out_{name.replace(' ', '_')}"
        if "--output-dir" not in argv:
            argv = [*argv, "--output-dir", str(out)]
        before = sorted(p.name for p in tmp_path.iterdir())
        code = main.main(argv)
        _, err = capfd.readouterr()
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, name
        assert len(lines) == 1 and lines[0].startswith("main.py: error: ") and expected in lines[0], (name, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, name  # nothing created
    assert (tmp_path / "a_file").read_text() == "precious"


def test_an_existing_run_is_not_overwritten_without_resume(tmp_path, tiny_model_dir, capfd):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    code = load_main().main(["--model", str(tiny_model_dir), "--output-dir", str(out)])
    assert code == 2 and "--resume" in capfd.readouterr().err
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n' and sorted(os.listdir(out)) == ["metrics.jsonl"]


def test_bad_input_from_a_real_process(tmp_path):
    res = run_main("--steps", "0", "--output-dir", str(tmp_path / "o"))
    assert res.returncode == 2 and res.stderr.strip() == "main.py: error: --steps must be >= 1, got 0"
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- end to end (the embedded model)


@pytest.mark.slow
@needs_asset
def test_a_short_run_writes_every_output(tmp_path):
    out = tmp_path / "run"
    res = run_main(*SMALL, "--steps", "3", "--eval-every", "2", "--checkpoint-every", "2", "--output-dir", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/reward" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 3]
    assert all(0 <= r[k] <= 1 for r in rows if "eval/accuracy" in r for k in ("eval/accuracy", "eval/pass@2"))
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = (out / "samples.txt").read_text()
    assert "[assistant" in samples and "expected:" in samples and "reward:" in samples
    assert "| step | greedy acc |" in (out / "summary.md").read_text()
    assert "held-out greedy accuracy" in res.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000003"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    AutoTokenizer.from_pretrained(out / "final")
    from safetensors.torch import load_file

    ckpt = load_file(str(out / "checkpoints" / "step-000003" / "model.safetensors"))
    for name, p in model.state_dict().items():
        if name in ckpt:
            assert torch.equal(p, ckpt[name]), name


@pytest.mark.slow
@needs_asset
def test_logged_train_metrics_do_not_depend_on_the_micro_batch_size(tmp_path):
    """16 rollouts a step in micro-batches of 4 and of 16: the same logged loss, entropy and clip fraction."""
    logged = {}
    for mb in (4, 16):
        out = tmp_path / f"mb{mb}"
        res = run_main("--model", str(MODEL), "--batch-size", "4", "--group-size", "4", "--eval-size", "2",
                       "--pass-k", "1", "--pass-k-size", "0", "--max-new-tokens", "24", "--threads", "1",
                       "--steps", "2", "--eval-every", "0", "--micro-batch-size", str(mb), "--output-dir", str(out))
        assert res.returncode == 0, res.stderr[-3000:]
        logged[mb] = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in logged[4]] == [r["step"] for r in logged[16]] == [1, 2]
    for small, big in zip(logged[4], logged[16], strict=True):
        assert small["train/tokens"] == big["train/tokens"]  # the same episodes
        assert small["train/loss"] == pytest.approx(big["train/loss"], abs=1e-6)
        assert small["train/entropy"] == pytest.approx(big["train/entropy"], rel=1e-5)
        assert small["train/clip_frac"] == pytest.approx(big["train/clip_frac"], rel=1e-5, abs=1e-12)
        assert small["train/entropy"] > 0


@pytest.mark.slow
@needs_asset
def test_sigkill_then_resume_reproduces_the_uninterrupted_run(tmp_path):
    args = [*SMALL, "--steps", "6", "--eval-every", "3", "--checkpoint-every", "2"]
    full_dir, killed_dir = tmp_path / "full", tmp_path / "killed"
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    popen = dict(cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    victim = subprocess.Popen([sys.executable, str(ROOT / "main.py"), *args, "--output-dir", str(killed_dir)],
                              **popen)
    full = subprocess.Popen([sys.executable, str(ROOT / "main.py"), *args, "--output-dir", str(full_dir)],
                            **popen)  # runs alongside the victim
    deadline = time.time() + 300
    while not list((killed_dir / "checkpoints").glob("step-*/MANIFEST.json")):
        assert victim.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert full.wait(timeout=600) == 0, full.stderr.read()[-3000:]
    assert not (killed_dir / "final").exists(), "the run finished before it could be killed"
    steps_done = [r["step"] for r in read_metrics(killed_dir / "metrics.jsonl") if "train/reward" in r]
    assert max(steps_done) < 6

    resumed = run_main(*args, "--output-dir", str(killed_dir), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    full_rows, resumed_rows = read_metrics(full_dir / "metrics.jsonl"), read_metrics(killed_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed_rows] == [r["step"] for r in full_rows]
    assert without_times(resumed_rows) == without_times(full_rows)  # every reward, loss, accuracy: exactly
    assert any(r.get("train/frac_zero_advantage", 1) < 1 for r in full_rows), "no learning signal: a vacuous test"
    from safetensors.torch import load_file

    a = load_file(str(full_dir / "final" / "model.safetensors"))
    b = load_file(str(killed_dir / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@needs_asset
def test_lora_run_saves_a_loadable_adapter(tmp_path, capfd):
    out = tmp_path / "lora"
    code = load_main().main([*SMALL, "--steps", "2", "--eval-every", "0", "--lora", "--lora-rank", "4",
                             "--output-dir", str(out)])
    assert code == 0, capfd.readouterr().err[-3000:]
    assert (out / "final" / "adapter_config.json").exists()
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(out / "final")
    lora = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert lora and any(v.abs().sum() > 0 for v in lora.values())  # B starts at zero: the adapter trained


def test_async_run_trains_with_bounded_staleness(tmp_path, capfd):
    out = tmp_path / "async"
    code = load_main().main([*SMALL, "--steps", "4", "--eval-every", "0", "--async-staleness", "1",
                             "--output-dir", str(out)])
    assert code == 0, capfd.readouterr().err[-3000:]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "train/staleness" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["train/staleness"] == 0 and all(0 <= r["train/staleness"] <= 1 for r in rows)
    assert max(r["train/staleness"] for r in rows) == 1  # the producer did run ahead
    assert all(r["train/drift/tokens"] > 0 for r in rows)
    evals = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in r]
    assert evals == [0, 4]  # the warm start, then the last step's evaluation from the background thread
    assert (out / "summary.md").exists() and (out / "samples.txt").exists()


@pytest.mark.slow
@needs_asset
def test_an_async_run_stopped_and_resumed_equals_the_uninterrupted_one(tmp_path, capfd):
    """--async-staleness 1: the producer samples step s by exactly version s - 2 (no thread timing), and a
    checkpoint keeps the weights its next batches are sampled by, so SIGTERM + --resume logs the same train
    rows and ends with the same weights as the uninterrupted run."""
    from safetensors.torch import load_file

    flags = [*SMALL, "--eval-every", "0", "--checkpoint-every", "0", "--async-staleness", "1", "--seed", "3",
             "--steps", "6"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert load_main().main([*flags, "--output-dir", str(whole)]) == 0
    code, err = sigterm_after_first_step(flags, parts)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    stopped = max(r["step"] for r in read_metrics(parts / "metrics.jsonl") if "train/reward" in r)
    assert 1 <= stopped < 6
    capfd.readouterr()
    assert load_main().main([*flags, "--output-dir", str(parts), "--resume"]) == 0, capfd.readouterr().err[-3000:]
    train = lambda out: without_times([r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r])  # noqa: E731
    assert [r["step"] for r in train(whole)] == [1, 2, 3, 4, 5, 6]
    assert train(parts) == train(whole)
    assert [r["train/staleness"] for r in train(whole)] == [0.0] + [1.0] * 5  # exactly K behind
    a, b = (load_file(str(out / "final" / "model.safetensors")) for out in (whole, parts))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- issue 16: fail loudly, lose nothing


FINISHED = [*SMALL, "--steps", "2", "--checkpoint-every", "1", "--eval-every", "0", "--lora", "--lora-rank", "4",
            "--wandb"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step LoRA run (checkpoints at steps 1 and 2) logged to a fake W&B; tests copy it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    fake = FakeWandb()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "wandb", fake)
        assert load_main().main([*FINISHED, "--output-dir", str(out)]) == 0
    return out, fake.inits[0]


def _copy_run(finished_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run[0], out)
    return out


def _snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(path.rglob("*"))}


def _refused(argv, out: Path, capfd, expected: str) -> str:
    """main(argv) exits 2 with one line naming `expected`, and `out` is untouched."""
    before = _snapshot(out)
    code = load_main().main(argv)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("main.py: error: ") and expected in lines[0], err
    assert _snapshot(out) == before
    return lines[0]


@needs_asset
@pytest.mark.parametrize("flag, value", [("--lora-alpha", "8"), ("--lora-rank", "8"), ("--seed", "1")])
def test_resume_compares_every_weight_shaping_flag_before_loading(finished_run, tmp_path, capfd, flag, value):
    out = _copy_run(finished_run, tmp_path)
    argv = [*(a for a in FINISHED if a != "--wandb"), "--output-dir", str(out), "--resume", flag, value]
    line = _refused(argv, out, capfd, flag)
    assert "checkpointed run" in line and "size mismatch" not in line


@needs_asset
def test_resume_refuses_another_architecture_under_the_same_model_path(tmp_path, capfd):
    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    out = tmp_path / "run"
    argv = [*SMALL, "--model", str(model), "--steps", "1", "--eval-every", "0", "--eval-size", "2",
            "--output-dir", str(out)]
    assert load_main().main(argv) == 0
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (model / "config.json").write_text(json.dumps(config))
    capfd.readouterr()
    line = _refused([*argv, "--resume"], out, capfd, "num_hidden_layers 3 -> 2")
    assert "architecture" in line


@needs_asset
def test_every_checkpoint_corrupt_is_refused_unless_restart(finished_run, tmp_path, capfd):
    out = _copy_run(finished_run, tmp_path)
    for ckpt in (out / "checkpoints").iterdir():
        with open(ckpt / "model.safetensors", "r+b") as f:
            f.seek(64)
            f.write(b"\x00\xff\x00\xff")
    argv = [*FINISHED, "--steps", "3", "--output-dir", str(out)]
    _refused([*argv, "--resume"], out, capfd, "--restart")
    old_rows = read_metrics(out / "metrics.jsonl")
    code = load_main().main([*argv, "--steps", "1", "--restart"])
    assert code == 0, capfd.readouterr().err[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/reward" in r] == [1] and rows != old_rows
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]


@needs_asset
def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(finished_run, tmp_path, capfd):
    out = _copy_run(finished_run, tmp_path)
    _refused([*FINISHED, "--steps", "1", "--output-dir", str(out), "--resume"], out, capfd, "--steps 1")


@needs_asset
def test_resuming_a_finished_run_without_its_metrics_keeps_its_curves(finished_run, tmp_path, capfd):
    out = _copy_run(finished_run, tmp_path)
    (out / "metrics.jsonl").unlink()
    curves, summary = (out / "curves.png").read_bytes(), (out / "summary.md").read_text()
    code = load_main().main([*FINISHED, "--output-dir", str(out), "--resume"])
    captured = capfd.readouterr()
    assert code == 0, captured.err[-3000:]
    assert (out / "curves.png").read_bytes() == curves and (out / "summary.md").read_text() == summary
    assert "holds no evaluation" in captured.out


@needs_asset
def test_a_bad_middle_line_of_the_log_refuses_resume_naming_it(finished_run, tmp_path, capfd):
    out = _copy_run(finished_run, tmp_path)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = '{"step": 1, "train/reward": nope}\n'  # not a tear (a record cut short is skipped): refused
    (out / "metrics.jsonl").write_text("".join(lines))
    _refused([*FINISHED, "--steps", "3", "--output-dir", str(out), "--resume"], out, capfd, "line 2")


@needs_asset
def test_a_resumed_run_continues_its_wandb_run(finished_run, tmp_path, capfd, monkeypatch):
    out = _copy_run(finished_run, tmp_path)
    first_id = finished_run[1].get("id")
    assert first_id is None  # a new run: W&B chose its id, stored in the checkpoints
    state = json.loads((out / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["wandb_run_id"] == "run1"
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    code = load_main().main([*FINISHED, "--steps", "3", "--output-dir", str(out), "--resume"])
    assert code == 0, capfd.readouterr().err[-3000:]
    assert fake.inits[0]["id"] == "run1" and fake.inits[0]["resume"] == "allow"


# ---------------------------------------------------------------- the GPU flags, exercised on the CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_exit_2(tmp_path):
    res = run_main(*SMALL, "--device", "cuda", "--output-dir", str(tmp_path / "out"))
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    assert lines[0] == "main.py: error: --device cuda: CUDA is not available on this machine (use --device cpu or auto)"
    assert not (tmp_path / "out").exists()


@needs_asset
def test_bfloat16_with_gradient_checkpointing_trains_and_resume_keeps_the_dtype(tmp_path, capfd):
    out = tmp_path / "bf16"
    argv = [*SMALL, "--steps", "2", "--eval-every", "0", "--eval-size", "2", "--dtype", "bfloat16",
            "--gradient-checkpointing", "--output-dir", str(out)]
    assert load_main().main(argv) == 0, capfd.readouterr().err[-3000:]
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["train/grad_norm"]) for r in rows)
    state = json.loads((out / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["args"]["dtype"] == "bfloat16" and state["args"]["device"] == "cpu"
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(out / "final" / "model.safetensors")).values()} == {torch.bfloat16}
    capfd.readouterr()
    again = [*SMALL, "--steps", "3", "--eval-every", "0", "--eval-size", "2", "--output-dir", str(out), "--resume"]
    line = _refused(again, out, capfd, "--dtype")  # --dtype auto is float32 on a CPU
    assert "'float32'" in line and "'bfloat16'" in line


@needs_asset
def test_a_checkpoint_whose_weights_do_not_fit_is_one_line_exit_2(tmp_path, capfd):
    out = tmp_path / "run"
    argv = [*SMALL, "--steps", "1", "--eval-every", "0", "--eval-size", "2", "--output-dir", str(out)]
    assert load_main().main(argv) == 0
    ckpt = out / "checkpoints" / "step-000001"
    from safetensors.torch import load_file, save_file

    weights = load_file(str(ckpt / "model.safetensors"))
    name = next(k for k, v in weights.items() if v.dim() == 2)
    weights[name] = torch.zeros(weights[name].shape[0] + 1, weights[name].shape[1])  # another architecture's
    save_file(weights, str(ckpt / "model.safetensors"))
    from SimpleTorchLLMRL.utils.checkpoint import MANIFEST, _sha256

    manifest = json.loads((ckpt / MANIFEST).read_text())  # kept verifiable: the refusal must come from the weights
    path = ckpt / "model.safetensors"
    manifest["files"]["model.safetensors"] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    capfd.readouterr()
    line = _refused([*argv, "--steps", "2", "--resume"], out, capfd, "does not fit the model")
    assert "size mismatch" in line


def test_unequal_json_columns_are_one_line(tmp_path):
    (tmp_path / "cols.json").write_text(json.dumps({"question": ["a", "b", "c"], "answer": ["1", "2"]}))
    with pytest.raises(DatasetError, match="columns differ in length.*'question' has 3, 'answer' has 2"):
        read_rows(str(tmp_path / "cols.json"))


def test_more_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, tiny_model_dir, capfd):
    long_rows = tmp_path / "long.jsonl"
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(9)]
    rows.insert(4, {"question": "What is " + " + ".join(["1"] * 1500) + "?", "answer": "1500"})
    long_rows.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cases = {
        "row over the context": (["--dataset", str(long_rows)], "over the model's context of 2048 tokens"),
        "pass-k unbounded": (["--pass-k", "1000000"], "--pass-k must be <= 64"),
        "output dir under /proc": (["--output-dir", "/proc/simpletorchllmrl-test/out"], "is not writable"),
        "resume and restart": (["--resume", "--restart"], "exclusive"),
    }
    if os.geteuid() != 0:  # root writes into a mode-555 directory anyway
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        cases["output dir under a read-only parent"] = (["--output-dir", str(locked / "new" / "out")],
                                                        "is not writable")
    main = load_main()
    for name, (argv, expected) in cases.items():
        if "--output-dir" not in argv:
            argv = [*argv, "--output-dir", str(tmp_path / "out")]
        before = sorted(p.name for p in tmp_path.iterdir())
        code = main.main(["--model", str(tiny_model_dir), *argv])
        lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and expected in lines[0], (name, lines)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, name


def test_help_documents_restart_and_the_pass_k_bound():
    from SimpleTorchLLMRL.recipes.calculator.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--restart" in text and "start over from step 0" in text and "at most 64" in text
    assert "143 / 130 stopped by SIGTERM / SIGINT" in text


def test_a_second_signal_stops_at_once():
    script = ("import os, signal, sys, time\n"
              "from SimpleTorchLLMRL.recipes.calculator.train_loop import StopOnSignal\n"
              "with StopOnSignal() as stop:\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(0.2)\n"
              "    assert stop.requested and stop.exit_status == 143\n"
              "    print('asked to stop', flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(30)\n"
              "print('survived the second signal', flush=True)\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "asked to stop" and res.returncode == -signal.SIGTERM, res
    assert "stopping after this step" in res.stderr


@pytest.mark.slow
@needs_asset
def test_sigterm_stops_at_the_step_boundary_with_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    code, err = sigterm_after_first_step([*SMALL, "--steps", "200", "--eval-every", "0", "--checkpoint-every", "0"],
                                         out, poll=0.05)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM: stopping after this step" in err
    last = max(r["step"] for r in read_metrics(out / "metrics.jsonl") if "train/reward" in r)
    assert last < 200
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step-{last:06d}"]  # the step it stopped at
    assert not (out / "final").exists()
