"""main.py's output dir is never silently wrong: one run at a time, --restart and --resume through
symlinks, and a full disk (issue 34)."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from SimpleTorchLLMRL.recipes.calculator.cli import DEFAULT_MODEL, UsageError
from SimpleTorchLLMRL.recipes.calculator.train_loop import LOCK_NAME, RunLock
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer
from SimpleTorchLLMRL.utils.checkpoint import find_checkpoint, save_checkpoint
from SimpleTorchLLMRL.utils.metrics import read_metrics
from tests.utils.test_checkpoint import tiny_tmpfs  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("MAIN_TEST_MODEL", DEFAULT_MODEL))
needs_asset = pytest.mark.skipif(not (MODEL / "model.safetensors").exists(),
                                 reason=f"the embedded model is not built yet ({MODEL})")
# one short step; what a refused run would train if it were not refused
ONE_STEP = ["--model", str(MODEL), "--batch-size", "2", "--group-size", "2", "--max-new-tokens", "8", "--steps", "1",
            "--eval-every", "0", "--eval-size", "2", "--pass-k", "1", "--pass-k-size", "1", "--threads", "1"]
OLD_ROWS = "".join(json.dumps({"step": s, "train/reward": 0.5}) + "\n" for s in range(1, 6))


def load_main():
    spec = importlib.util.spec_from_file_location("main_under_test", ROOT / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _snapshot(path: Path) -> dict:
    """Every entry under `path` without following links: a link's target, a file's bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(path))] = (os.readlink(p) if p.is_symlink() else
                                             p.read_bytes() if p.is_file() else "dir")
    return out


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("main.py: error: ")]


# ---------------------------------------------------------------- one run at a time


def test_the_run_lock_names_its_holder_and_goes_with_it(tmp_path):
    with RunLock() as first:
        first.acquire(tmp_path)
        first.acquire(tmp_path)  # idempotent
        with pytest.raises(UsageError, match=rf"in use by another run \(pid {os.getpid()}\)"):
            RunLock().acquire(tmp_path)
    assert os.listdir(tmp_path) == []  # released: the file goes too
    (tmp_path / LOCK_NAME).write_text("999999 another-host\n")  # left by a killed run: no flock holds it
    with RunLock() as second:
        second.acquire(tmp_path)
        assert (tmp_path / LOCK_NAME).read_text().split()[0] == str(os.getpid())
    assert os.listdir(tmp_path) == []


@needs_asset
def test_a_second_run_in_the_same_output_dir_exits_2_naming_the_first(tmp_path, capfd):
    out = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    first = subprocess.Popen([sys.executable, str(ROOT / "main.py"), *ONE_STEP, "--steps", "200",
                              "--checkpoint-every", "1", "--output-dir", str(out)],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not list((out / "checkpoints").glob("step-*")):  # training, and saving
            assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:]
            time.sleep(0.05)
        code = load_main().main([*ONE_STEP, "--steps", "200", "--output-dir", str(out), "--resume"])
        err = capfd.readouterr().err
        assert code == 2, err[-3000:]
        assert _error_lines(err) == [f"main.py: error: --output-dir {out} is in use by another run "
                                     f"(pid {first.pid}); wait for it to end or choose another --output-dir"], err
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)


# ---------------------------------------------------------------- --restart and --resume through symlinks


@pytest.fixture
def old_run(tmp_path):
    """An output dir whose checkpoints/ and final/ are symlinks to another disk, holding a step-5 run."""
    out, disk = tmp_path / "run", tmp_path / "disk"
    out.mkdir()
    (out / "metrics.jsonl").write_text(OLD_ROWS)
    tok = tiny_tokenizer("chatml")
    model = tiny_model("llama", tok)
    save_checkpoint(disk / "checkpoints", 5, model, state={"data_position": 10})
    (disk / "final").mkdir()
    (disk / "final" / "old-model.txt").write_text("the old run's final model")
    for name in ("checkpoints", "final"):
        (out / name).symlink_to(disk / name)
    return out, disk


@needs_asset
def test_restart_through_symlinks_empties_their_targets_and_keeps_the_links(old_run, capfd):
    out, disk = old_run
    code = load_main().main([*ONE_STEP, "--checkpoint-every", "1", "--output-dir", str(out), "--restart"])
    assert code == 0, capfd.readouterr().err[-3000:]
    # before: the old step-000005 stayed (rmtree of a link fails quietly), and --resume took it up
    assert sorted(os.listdir(disk / "checkpoints")) == ["step-000001"]
    assert find_checkpoint(out / "checkpoints")[0] == out / "checkpoints" / "step-000001"
    assert (out / "checkpoints").is_symlink() and (out / "final").is_symlink()
    assert "old-model.txt" not in os.listdir(disk / "final") and (disk / "final" / "config.json").exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "train/reward" in r] == [1]


@needs_asset
@pytest.mark.parametrize("broken", ["dangling", "loop", "file"])
@pytest.mark.parametrize("mode", ["--resume", "--restart"])
def test_a_broken_checkpoints_dir_exits_2_and_changes_nothing(old_run, capfd, broken, mode):
    out, disk = old_run
    link = out / "checkpoints"
    link.unlink()
    if broken == "dangling":
        link.symlink_to(disk / "unmounted")
        expected = f"{link} is a dangling symlink (to {disk / 'unmounted'})"
    elif broken == "loop":
        link.symlink_to(link)
        expected = f"{link} cannot be read"
    else:
        link.write_text("not a directory")
        expected = f"{link} is not a directory"
    before = _snapshot(out.parent)
    code = load_main().main([*ONE_STEP, "--output-dir", str(out), mode])
    err = capfd.readouterr().err
    assert code == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"main.py: error: --output-dir {out}: {expected}"), err
    # before (--resume): "no checkpoint", step 0, metrics.jsonl cut from 5 rows to 2, then a raw FileExistsError
    assert _snapshot(out.parent) == before
    assert (out / "metrics.jsonl").read_text() == OLD_ROWS


# ---------------------------------------------------------------- a full disk


@needs_asset
def test_a_full_disk_while_saving_is_one_line_exit_2_and_no_partial_folder(tmp_path, capfd, monkeypatch):
    out = tmp_path / "run"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    code = load_main().main([*ONE_STEP, "--output-dir", str(out)])
    err = capfd.readouterr().err
    assert code == 2, err[-3000:]
    assert "Traceback" not in err
    assert _error_lines(err) == [f"main.py: error: no space left on device writing "
                                 f"{out / 'checkpoints' / 'step-000001'}"], err
    assert os.listdir(out / "checkpoints") == []  # the partial .tmp-step-000001-* is gone
    assert LOCK_NAME not in os.listdir(out)


@needs_asset
def test_a_real_full_disk_while_saving_is_one_line_exit_2(tmp_path, capfd, tiny_tmpfs):  # noqa: F811
    disk = tiny_tmpfs(6 << 20)  # metrics.jsonl and the weights fit; the optimizer's two moments do not
    out = disk / "run"
    code = load_main().main([*ONE_STEP, "--output-dir", str(out)])
    err = capfd.readouterr().err
    assert code == 2, err[-3000:]
    assert _error_lines(err) == [f"main.py: error: no space left on device writing "
                                 f"{out / 'checkpoints' / 'step-000001'}"], err
    assert os.listdir(out / "checkpoints") == []
