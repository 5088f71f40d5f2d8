"""A log-prob is finite and at most 0 wherever a Message gets one (issue 43, item 3, messages and files).

Before (8c45457) `Message` and `load_rollouts` accepted -inf (GRPO then returned loss inf with a NaN
gradient norm) and +inf / NaN slipped through a set attribute. Now a Message refuses a non-finite value or
one above LOGPROB_SLACK, at construction and when set later, naming the position; a rollout file names the
line (or row) and the message. Generated turns (and the gateway's recorded turns, which are the
generator's Messages or `dataclasses.replace` copies of them) go through the same check.
"""

import dataclasses
import json
import math

import pytest

from SimpleTorchLLMRL.chat.message import LOGPROB_SLACK, Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.rollout_io import load_rollouts, save_rollouts
from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
from SimpleTorchLLMRL.model.generation.sampling import Sample

BAD = [float("-inf"), float("inf"), float("nan"), 50.0, 1e-3]


def turn(logprobs, content="ab"):
    return Message(content, MessageType.MODEL, token_ids=list(range(len(logprobs))), logprobs=logprobs)


@pytest.mark.parametrize("bad", BAD)
def test_a_message_refuses_a_value_that_is_no_log_prob_and_names_where(bad):
    with pytest.raises(ValueError, match=rf"logprobs\[2\] is {bad}: log-probabilities must be finite and <= 0"):
        turn([-0.1, -0.2, bad, -0.3])
    m = turn([-0.1, -0.2])
    with pytest.raises(ValueError, match=r"logprobs\[1\]"):  # set after construction: checked too
        m.logprobs = [-0.5, bad]
    assert m.logprobs == [-0.1, -0.2]
    with pytest.raises(ValueError, match=r"logprobs\[0\]"):
        dataclasses.replace(m, logprobs=[bad, -1.0])


def test_rounding_just_above_zero_is_kept_as_given():
    m = turn([0.0, LOGPROB_SLACK, -0.0, -1e30])
    assert m.logprobs == [0.0, LOGPROB_SLACK, 0.0, -1e30]
    with pytest.raises(ValueError):
        turn([2 * LOGPROB_SLACK])


def _rollout_record(logprob):
    good = Rollout([Message("q"), turn([-0.1, -0.2])]).to_dict()
    good["messages"][1]["logprobs"] = [-0.1, logprob]
    return good


@pytest.mark.parametrize("bad", BAD)
def test_a_rollout_file_with_such_a_value_is_refused_naming_line_and_message(tmp_path, bad):
    path = tmp_path / "r.jsonl"
    ok = json.dumps(_rollout_record(-0.5))
    path.write_text(ok + "\n" + json.dumps(_rollout_record(bad)) + "\n")  # json writes -Infinity, NaN
    with pytest.raises(ValueError, match=r"r\.jsonl: line 2: message 1: Message logprobs\[1\] is"):
        load_rollouts(path)
    assert len(load_rollouts(_only(tmp_path, ok))) == 1


def _only(tmp_path, line):
    path = tmp_path / "ok.jsonl"
    path.write_text(line + "\n")
    return path


def test_a_parquet_file_with_minus_inf_is_refused_naming_the_row(tmp_path, monkeypatch):
    pytest.importorskip("pyarrow")
    from SimpleTorchLLMRL.chat import rollout_io

    path = save_rollouts(tmp_path / "r.parquet", [Rollout([Message("q"), turn([-0.1, -0.2])])] * 2)
    rows = rollout_io._read_parquet(path)
    rows[1]["messages"][1]["logprobs"] = [-0.1, float("-inf")]
    monkeypatch.setattr(rollout_io, "_read_parquet", lambda p: rows)
    with pytest.raises(ValueError, match=r"row 1: message 1: Message logprobs\[1\] is -inf"):
        load_rollouts(path)


def test_a_generated_turn_with_minus_inf_is_refused(qwen2_model, chatml_tokenizer, monkeypatch):
    """Whatever a backend (HF, vLLM) reports goes through Message: a -inf never reaches a rollout."""
    gen = ModelGenerate(qwen2_model, chatml_tokenizer, max_new_tokens=2)
    ids = chatml_tokenizer("hi", add_special_tokens=False)["input_ids"][:1]

    def fake(prompts, n, seed, *, sampling, **kw):
        return [[Sample(ids, [-math.inf], "length", chatml_tokenizer.decode(ids))] * n for _ in prompts]

    monkeypatch.setattr(gen.backend, "generate", fake)
    with pytest.raises(ValueError, match=r"logprobs\[0\] is -inf"):
        gen.generate([Rollout([Message("hello")])])


def test_the_gateway_records_generated_turns_as_they_are():
    """The gateway's recorded replies are the generator's Messages; naming one (the only change it makes)
    is a `dataclasses.replace`, which checks again."""
    from SimpleTorchLLMRL.gateway.sessions import named

    reply = turn([-0.1, -0.2])
    assert named(reply, "bob").logprobs == [-0.1, -0.2] and named(reply, "bob").name == "bob"
    object.__setattr__(reply, "logprobs", [-0.1, -math.inf])  # forced past the check
    with pytest.raises(ValueError, match=r"logprobs\[1\] is -inf"):
        named(reply, "bob")


def test_a_model_with_nan_logits_gives_no_turn_that_trains():
    """A NaN log-prob stays NaN through the backends' clamp (`min(0.0, nan)` is 0.0: a broken model's turn
    would train as certain), so `Message` refuses it."""
    from SimpleTorchLLMRL.model.generation.sampling import clamp_logprob

    assert clamp_logprob(1e-7) == 0.0 and clamp_logprob(-0.5) == -0.5
    assert math.isnan(clamp_logprob(float("nan")))
    with pytest.raises(ValueError, match=r"logprobs\[0\] is nan"):
        Message("x", MessageType.MODEL, token_ids=[1], logprobs=[clamp_logprob(float("nan"))])
