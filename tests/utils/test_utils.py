"""The pieces every training loop shares: the JSONL reader, the checked optimizer step, atomic exports."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from SimpleTorchLLMRL.utils.checkpoint import load_checkpoint, save_checkpoint, save_pretrained_atomic
from SimpleTorchLLMRL.utils.jsonl import cut_short, jsonl_records, read_jsonl
from SimpleTorchLLMRL.utils.metrics import MetricsLogger, read_metrics
from SimpleTorchLLMRL.utils.training import NonFiniteError, clipped_step, warmup_constant
from tests.support.fake_wandb import FakeWandb

# ----------------------------------------------------------------------------- JSONL


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3, "b"')
    with pytest.warns(UserWarning, match="torn"):
        assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
    assert read_jsonl(path, torn_tail="skip") == [{"a": 1}, {"a": 2}]
    with pytest.raises(ValueError, match="line 4 is not JSON"):
        read_jsonl(path, torn_tail="error")


def test_a_bad_line_that_is_not_the_torn_tail_is_an_error(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"a": 1}\nnot json\n{"a": 3}\n')
    with pytest.raises(ValueError, match=r"m.jsonl: line 2 is not JSON"):
        read_jsonl(path)
    # a complete (newline-terminated) last line that does not parse was not torn by a kill: an error
    with pytest.raises(ValueError, match="line 2"):
        list(jsonl_records('{"a": 1}\n{"a"\n', "x", torn_tail="skip"))


def test_line_numbers_count_blank_lines():
    assert list(jsonl_records('\n{"a": 1}\n\n[2]\n', "x")) == [(2, {"a": 1}), (4, [2])]


def test_every_prefix_of_a_record_is_cut_short_and_nothing_else_is():
    record = {"a": [1, -2.5e-3, 0, True, False, None, float("nan"), -float("inf")], "é": 'caf\u00e9 "q" \\ \n\x01 😀',
              "n": {"x": [], "y": {}}, "big": 12345678901234567890, "e": 1e300}
    for ensure_ascii in (True, False):  # \uXXXX escapes (surrogate pairs too), or the characters themselves
        for separators in (None, (",", ":")):
            text = json.dumps(record, ensure_ascii=ensure_ascii, separators=separators)
            assert not cut_short(text)
            assert [k for k in range(len(text)) if not cut_short(text[:k])] == []
    for wrong in ["not json", "{not json", '{"a": 1} x', '{"a": 1}}', '{"a": tx', '{"a": é', "[1,,", '{"a" 1',
                  '{"a": 1 2', '"a\\u00g', '{"a":01', '{"a":1.e', "[1] "]:
        assert not cut_short(wrong), wrong


def test_bytes_are_decoded_line_by_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes('{"a": "é"}\n{"a": "ü"}\n'.encode() + '{"a": "é"}'.encode()[:-3])  # torn inside the é
    with pytest.warns(UserWarning, match="last line is torn"):
        assert read_jsonl(path) == [{"a": "é"}, {"a": "ü"}]
    # a tear mid-file: a later writer started on a new line after it
    path.write_bytes('{"a": "é"}\n'.encode()[:-4] + b"\n" + '{"a": "ü"}\n'.encode())
    with pytest.warns(UserWarning, match="line 1 is torn"):
        assert read_jsonl(path) == [{"a": "ü"}]
    with pytest.raises(ValueError, match="line 1 ends inside a UTF-8 character"):
        read_jsonl(path, torn_tail="error")
    path.write_bytes(b'{"a": "\xff"}\n{"a": 2}\n')
    with pytest.raises(ValueError, match="line 1 is not UTF-8"):
        read_jsonl(path)


def test_torn_tail_mode_is_checked():
    with pytest.raises(ValueError, match="torn_tail"):
        list(jsonl_records("", "x", torn_tail="maybe"))


# ----------------------------------------------------------------------------- the checked step


def _model_and_opt(lr=0.1):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def test_clipped_step_clips_steps_and_zeroes():
    model, opt = _model_and_opt()
    before = model.weight.detach().clone()
    (model(torch.ones(2, 4)).sum() * 100).backward()
    want = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    norm = clipped_step(opt, max_grad_norm=1.0)
    assert norm == pytest.approx(want) and norm > 1.0
    moved = torch.cat([(model.weight.detach() - before).flatten()])
    assert 0 < float(moved.norm()) <= 0.1 + 1e-6  # lr x clipped norm (weight part of it)
    assert all(p.grad is None for p in model.parameters())


def test_a_nan_gradient_skips_the_step_and_says_so():
    model, opt = _model_and_opt()
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.ones(2, 4)).sum() * float("nan")).backward()
    with pytest.raises(NonFiniteError, match="gradient norm is nan"):
        clipped_step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_an_infinite_learning_rate_is_refused_after_the_step():
    model, opt = _model_and_opt(lr=math.inf)
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(NonFiniteError, match="weights"):
        clipped_step(opt)


def test_warmup_constant_reaches_one_after_warmup():
    f = warmup_constant(3)
    assert [f(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert warmup_constant(0)(0) == 1.0


# ----------------------------------------------------------------------------- checkpoints and exports


def test_extra_state_round_trips(tmp_path):
    model, opt = _model_and_opt()
    critic = torch.nn.Linear(3, 1)
    path = save_checkpoint(tmp_path, 7, model, opt, extra={"critic": critic.state_dict()}, state={"x": 1})
    state = load_checkpoint(path, model, opt)
    assert state["step"] == 7 and state["x"] == 1
    assert torch.equal(state["extra"]["critic"]["weight"], critic.weight)


class _Saves:
    def __init__(self, fail: bool = False):
        self.fail = fail

    def save_pretrained(self, path):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({"new": True}))
        if self.fail:
            raise OSError("disk full")


def test_save_pretrained_atomic_replaces_whole_or_not_at_all(tmp_path):
    final = tmp_path / "final"
    assert save_pretrained_atomic(_Saves(), None, final) == "full"
    (final / "config.json").write_text('{"old": true}')
    with pytest.raises(OSError, match="disk full"):
        save_pretrained_atomic(_Saves(fail=True), None, final)
    assert json.loads((final / "config.json").read_text()) == {"old": True}  # the previous export is intact
    save_pretrained_atomic(_Saves(), None, final)
    assert json.loads((final / "config.json").read_text()) == {"new": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_metrics_logger_resumes_the_given_wandb_run(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    first = MetricsLogger(tmp_path, use_wandb=True, console=False, wandb_mode="offline")
    run_id = first.wandb_run_id
    assert run_id == "run1" and "id" not in fake.inits[0]  # a new run: W&B picks the id
    first.close()
    again = MetricsLogger(tmp_path, use_wandb=True, console=False, append=True, run_id=run_id,
                          wandb_mode="offline")
    assert fake.inits[1]["id"] == run_id and fake.inits[1]["resume"] == "allow"
    assert again.wandb_run_id == run_id
    again.close()
    assert MetricsLogger(tmp_path / "plain", console=False).wandb_run_id is None


def test_metrics_logger_appending_after_a_torn_line_starts_a_new_line(tmp_path):
    first = MetricsLogger(tmp_path, console=False)
    first.log(1, {"loss": 1.0})
    first.close()
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(path.read_bytes() + b'{"step": 2, "lo')  # a run killed mid-write
    again = MetricsLogger(tmp_path, console=False, append=True)
    again.log(3, {"loss": 0.5})
    again.close()
    assert path.read_bytes().count(b"\n") == 3  # the fragment kept its own line
    assert [r["step"] for r in read_metrics(path)] == [1, 3]  # skipped; every whole row reads
