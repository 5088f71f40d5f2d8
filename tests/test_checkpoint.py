import json
import random

import numpy as np
import pytest
import torch

from SimpleTorchLLMRL.testing.tiny import tiny_model
from SimpleTorchLLMRL.utils.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
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


def test_metrics_logger_jsonl(tmp_path, capsys):
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"loss": torch.tensor(0.5), "reward": 1.0, "nan": float("nan")})
        log.log(2, {"loss": 0.25})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "los')  # a torn line from a killed run
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 0.5, "reward": 1.0, "nan": None}, {"step": 2, "loss": 0.25}]
    assert "[step 1] loss=0.5" in capsys.readouterr().out
