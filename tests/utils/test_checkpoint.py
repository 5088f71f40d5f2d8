import errno
import json
import os
import random
import shutil
import subprocess
import types

import numpy as np
import pytest
import torch

from SimpleTorchLLMRL.testing.tiny import tiny_model
from SimpleTorchLLMRL.utils.checkpoint import (
    CheckpointError,
    find_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_pretrained_atomic,
    verify_checkpoint,
)
from SimpleTorchLLMRL.utils.metrics import MetricsLogger, read_metrics


def _train_step(model, opt):
    x = torch.randint(0, 100, (2, 8))
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_roundtrip_restores_model_optimizer_rng_and_state(tmp_path, chatml_tokenizer):
    model = tiny_model("qwen2", chatml_tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    _train_step(model, opt)
    sched.step()
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    path = save_checkpoint(tmp_path, 1, model, opt, sched, state={"data_position": 32})
    expected_draws = (torch.rand(3), random.random(), np.random.rand())
    _train_step(model, opt)  # continue: weights and optimizer move on

    fresh = tiny_model("qwen2", chatml_tokenizer, seed=123)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, 1, gamma=0.5)
    state = load_checkpoint(path, fresh, fresh_opt, fresh_sched)
    assert state == {"step": 1, "data_position": 32}
    assert torch.equal(torch.rand(3), expected_draws[0])
    assert random.random() == expected_draws[1] and np.random.rand() == expected_draws[2]
    assert fresh_sched.get_last_lr() == sched.get_last_lr() or fresh_sched.last_epoch == 1
    # Same next step from the restored state as from the original state.
    ref = tiny_model("qwen2", chatml_tokenizer, seed=5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    load_checkpoint(path, ref, ref_opt, restore_rng=False)
    torch.manual_seed(0)
    _train_step(fresh, fresh_opt)
    torch.manual_seed(0)
    _train_step(ref, ref_opt)
    for a, b in zip(fresh.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_partial_and_corrupt_checkpoints_are_skipped(tmp_path, chatml_tokenizer):
    model = tiny_model("qwen2", chatml_tokenizer)
    save_checkpoint(tmp_path, 1, model, keep_last=None)
    good = save_checkpoint(tmp_path, 2, model, keep_last=None)
    corrupt = save_checkpoint(tmp_path, 3, model, keep_last=None)
    with open(corrupt / "model.safetensors", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\xff\x00\xff")
    partial = tmp_path / "step-000004"
    partial.mkdir()
    (partial / "state.json").write_text(json.dumps({"step": 4}))
    assert verify_checkpoint(partial) == "no manifest (partial write)"
    assert "does not match" in verify_checkpoint(corrupt)
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert latest_checkpoint(tmp_path) == good
    with pytest.raises(ValueError, match="not usable"):
        load_checkpoint(corrupt, model)


@pytest.mark.parametrize("manifest", [b"\xff\xfe not utf-8 \x80", b"[]", b"{}", b'{"files": []}',
                                      b'{"files": {"state.json": 3}}', b'{"files": {}}', b"null"])
def test_a_manifest_of_any_bad_shape_is_corruption_and_falls_back(tmp_path, chatml_tokenizer, manifest):
    model = tiny_model("qwen2", chatml_tokenizer)
    good = save_checkpoint(tmp_path, 1, model, keep_last=None)
    bad = save_checkpoint(tmp_path, 2, model, keep_last=None)
    (bad / "MANIFEST.json").write_bytes(manifest)
    assert verify_checkpoint(bad).startswith("unreadable manifest")
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert latest_checkpoint(tmp_path) == good
    with pytest.raises(ValueError, match="not usable"):
        load_checkpoint(bad, model)


def test_keep_last_prunes_old_checkpoints(tmp_path, chatml_tokenizer):
    model = tiny_model("qwen2", chatml_tokenizer)
    killed_mid_save = tmp_path / ".tmp-step-000001-99999"
    killed_mid_save.mkdir()
    (killed_mid_save / "model.safetensors").write_bytes(b"partial")
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, model, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_peft_checkpoint_holds_only_the_adapter(tmp_path, chatml_tokenizer):
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    model = get_peft_model(tiny_model("qwen2", chatml_tokenizer), LoraConfig(r=4, target_modules="all-linear"))
    path = save_checkpoint(tmp_path, 1, model)
    keys = load_file(str(path / "model.safetensors")).keys()
    assert keys and all("lora_" in k for k in keys)


def test_the_writer_tells_a_peft_model_as_model_lora_does(chatml_tokenizer):
    """utils asks for adapters without importing model/ (the layers): both tests must give one answer."""
    from peft import LoraConfig, get_peft_model

    from SimpleTorchLLMRL.model.lora import is_peft_model
    from SimpleTorchLLMRL.utils.checkpoint import _holds_adapters

    plain = tiny_model("qwen2", chatml_tokenizer)
    peft = get_peft_model(tiny_model("qwen2", chatml_tokenizer), LoraConfig(r=4, target_modules="all-linear"))
    assert [_holds_adapters(m) for m in (plain, peft)] == [is_peft_model(m) for m in (plain, peft)] == [False, True]


def test_metrics_logger_jsonl(tmp_path, capsys):
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"loss": torch.tensor(0.5), "reward": 1.0, "nan": float("nan")})
        log.log(2, {"loss": 0.25})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "los')  # a torn line from a killed run
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 0.5, "reward": 1.0, "nan": None}, {"step": 2, "loss": 0.25}]
    assert "[step 1] loss=0.5" in capsys.readouterr().out


# ---------------------------------------------------------------- never silently wrong (issue 34)


def test_a_second_writer_leaves_the_first_ones_save_in_flight_alone(tmp_path, chatml_tokenizer, monkeypatch):
    """Writer B saves into the same directory while writer A is between two files of its checkpoint."""
    model = tiny_model("qwen2", chatml_tokenizer)
    real_save, interleaved = torch.save, []

    def save_with_a_second_writer(obj, f, *args, **kwargs):
        if not interleaved:  # A's first torch.save: B runs a whole save meanwhile
            interleaved.append(None)
            interleaved.append(save_checkpoint(tmp_path, 7, model, keep_last=None))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_with_a_second_writer)
    first = save_checkpoint(tmp_path, 3, model, keep_last=None)  # before: FileNotFoundError, B deleted A's folder
    assert verify_checkpoint(first) is None and verify_checkpoint(interleaved[1]) is None
    assert sorted(os.listdir(tmp_path)) == ["step-000003", "step-000007"]


def _no_free_space(monkeypatch, free: int = 0) -> None:
    usage = types.SimpleNamespace(total=10**9, used=10**9 - free, free=free)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)


def _raises(error):
    def write(*args, **kwargs):
        raise error
    return write


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")],
                         ids=["errno", "torch.save"])
def test_a_full_disk_is_one_line_naming_the_checkpoint_and_leaves_no_partial_folder(
        tmp_path, chatml_tokenizer, monkeypatch, error):
    model = tiny_model("qwen2", chatml_tokenizer)
    save_checkpoint(tmp_path, 1, model)
    _no_free_space(monkeypatch)
    monkeypatch.setattr(torch, "save", _raises(error))
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, 2, model)
    assert str(info.value) == f"no space left on device writing {tmp_path / 'step-000002'}"
    assert info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(tmp_path)) == ["step-000001"]  # the partial .tmp-step-000002-* is gone


def test_a_torch_save_failure_with_space_left_is_not_called_a_full_disk(tmp_path, chatml_tokenizer, monkeypatch):
    model = tiny_model("qwen2", chatml_tokenizer)
    _no_free_space(monkeypatch, free=50 << 30)
    monkeypatch.setattr(torch, "save", _raises(RuntimeError("[enforce fail at inline_container.cc:672] . boom")))
    with pytest.raises(RuntimeError, match="boom"):
        save_checkpoint(tmp_path, 1, model)
    assert os.listdir(tmp_path) == []


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """mount(bytes) -> a fresh tmpfs of that size (skipped where mounting is not permitted)."""
    mounted = []

    def mount(size: int):
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot mount a tmpfs here: {e}")
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        if subprocess.run(["umount", str(point)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=30)  # busy: detach it


def test_a_real_full_disk_is_one_line_and_leaves_no_partial_folder(tmp_path, chatml_tokenizer, tiny_tmpfs):
    model = tiny_model("qwen2", chatml_tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt)  # two moments per weight: optimizer.pt is twice model.safetensors
    probe = save_checkpoint(tmp_path / "probe", 1, model, opt)
    disk = tiny_tmpfs((probe / "model.safetensors").stat().st_size + (64 << 10))  # the weights fit, not the rest
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(disk / "checkpoints", 1, model, opt)
    assert str(info.value) == f"no space left on device writing {disk / 'checkpoints' / 'step-000001'}"
    assert os.listdir(disk / "checkpoints") == []
    assert shutil.disk_usage(disk).used < (64 << 10)  # the partial files' space is back (none held open)


def test_a_dangling_or_unreadable_checkpoint_directory_is_an_error_not_an_empty_one(tmp_path, chatml_tokenizer):
    model = tiny_model("qwen2", chatml_tokenizer)
    dangling, loop, a_file = tmp_path / "dangling", tmp_path / "loop", tmp_path / "a_file"
    dangling.symlink_to(tmp_path / "gone")
    loop.symlink_to(loop)
    a_file.write_text("precious")
    for path, why in [(dangling, "dangling symlink"), (loop, "cannot be read"), (a_file, "not a directory")]:
        with pytest.raises(CheckpointError, match=why):
            find_checkpoint(path)  # before: (None, []), "no checkpoint", and a run started over
        with pytest.raises(CheckpointError, match=why):
            save_checkpoint(path, 1, model)  # before: a raw FileExistsError
    assert not (tmp_path / "gone").exists() and a_file.read_text() == "precious"
    assert find_checkpoint(tmp_path / "missing") == (None, [])
    if os.geteuid() != 0:  # root reads a mode-000 directory anyway
        locked = tmp_path / "locked"
        save_checkpoint(locked, 1, model)
        locked.chmod(0)
        try:
            with pytest.raises(CheckpointError, match="cannot be read"):
                find_checkpoint(locked)
        finally:
            locked.chmod(0o755)


def test_keep_last_never_deletes_the_checkpoint_just_written(tmp_path, chatml_tokenizer):
    """An older run's higher steps are left alone, with a warning: they are not pruned in place of the new one."""
    model = tiny_model("qwen2", chatml_tokenizer)
    for step in (39, 40):
        save_checkpoint(tmp_path, step, model)
    with pytest.warns(UserWarning, match="step-000040, newer than step-000001"):
        new = save_checkpoint(tmp_path, 1, model, keep_last=2)
    assert verify_checkpoint(new) is None
    assert sorted(os.listdir(tmp_path)) == ["step-000001", "step-000039", "step-000040"]


def test_save_pretrained_atomic_through_a_symlink_keeps_the_link(tmp_path, chatml_tokenizer):
    model = tiny_model("qwen2", chatml_tokenizer)
    target = tmp_path / "disk" / "final"
    target.mkdir(parents=True)
    (target / "old.txt").write_text("an older model")
    link = tmp_path / "run" / "final"
    link.parent.mkdir()
    link.symlink_to(target)
    save_pretrained_atomic(model, chatml_tokenizer, link)
    assert link.is_symlink() and (target / "config.json").exists() and not (target / "old.txt").exists()
    assert os.listdir(link.parent) == ["final"] and sorted(os.listdir(target.parent)) == ["final"]
