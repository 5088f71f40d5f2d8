"""Rollouts as data: exact round trips (JSONL and Parquet), replay, policy versions, bounded staleness."""

import errno
import json
import math
import time
import warnings

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.rollout_io import RolloutWriter, load_rollouts, save_rollouts
from SimpleTorchLLMRL.chat.tokenize import encode_rollouts
from SimpleTorchLLMRL.env.async_rollouts import AsyncProducer, RolloutQueue
from SimpleTorchLLMRL.model.generation.generator import ModelGenerate, extend_groups
from SimpleTorchLLMRL.trainer.grpo import GRPO

S, U, M, T = MessageType.SYSTEM, MessageType.MESSAGE, MessageType.MODEL, MessageType.TOOL
CALL = {"type": "function", "id": "call00001", "function": {"name": "calculator", "arguments": {"expression": "3*9"}}}


def _rich_rollouts(tok):
    """Every message field and type: sampled turns (with log-probs and versions), a frozen agent, tool calls."""
    ids = tok("It is 27.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    lp = [-0.25 * (k + 1) for k in range(len(ids))]
    a = Rollout([Message("Be brief.", S), Message("Compute 3*9.", U),
                 Message("Let me call.", M, tool_calls=[CALL], name="alice", policy_version=3),
                 Message("27", T, tool_call_id="call00001"),
                 Message("It is 27.", M, token_ids=ids, logprobs=lp, temperature=0.7, finish_reason="stop",
                         name="alice", policy_version=4),
                 Message("Agreed.", M, name="bob", trainable=False),
                 Message("teach me", U, trainable=True)],
                {"group_id": 2, "answer": "27", "tools": [{"type": "function", "function": {"name": "calculator"}}],
                 "nested": {"x": [1, 2.5, None, True]}})
    b = Rollout([Message("q", U), Message(tok.decode(ids[:3]), M, token_ids=ids[:3], logprobs=lp[:3], temperature=0.7,
                                          finish_reason="length", policy_version=4)], {"group_id": 2})
    return [a, b]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip_is_exact_including_encodings(tmp_path, chatml_tokenizer, suffix):
    tok = chatml_tokenizer
    rollouts = _rich_rollouts(tok)
    path = save_rollouts(tmp_path / f"r{suffix}", rollouts)
    back = load_rollouts(path)
    assert [list(r) for r in back] == [list(r) for r in rollouts]  # every Message field
    assert [r.metadata for r in back] == [r.metadata for r in rollouts]
    for e1, e2 in zip(encode_rollouts(rollouts, tok), encode_rollouts(back, tok), strict=True):
        assert (e1.input_ids, e1.loss_mask, e1.message_index) == (e2.input_ids, e2.loss_mask, e2.message_index)
        same_nan = [math.isnan(x) for x in e1.sampler_logprobs] == [math.isnan(x) for x in e2.sampler_logprobs]
        assert same_nan and all(x == y for x, y in zip(e1.sampler_logprobs, e2.sampler_logprobs, strict=True)
                                if not math.isnan(x))


def test_parquet_is_one_row_per_rollout_for_pandas(tmp_path, chatml_tokenizer):
    import pandas as pd

    path = save_rollouts(tmp_path / "r.parquet", _rich_rollouts(chatml_tokenizer))
    df = pd.read_parquet(path)
    assert len(df) == 2 and list(df.columns) == ["format_version", "messages", "metadata"]
    assert json.loads(df.metadata[0])["answer"] == "27" and len(df.messages[0]) == 7


def test_dict_round_trip_and_errors(chatml_tokenizer):
    r = _rich_rollouts(chatml_tokenizer)[0]
    assert list(Rollout.from_dict(json.loads(json.dumps(r.to_dict())))) == list(r)
    bad = Rollout([Message("q", U)], {"when": object()})
    with pytest.raises(ValueError, match=r"metadata\['when'\] is a object"):
        bad.to_dict()
    with pytest.raises(ValueError, match="not representable"):
        Rollout([Message("q", U)], {"score": float("nan")}).to_dict()
    with pytest.raises(ValueError, match="newer than this library"):
        Rollout.from_dict({"format_version": 99, "messages": []})
    # collect_rollouts' live env_state is left out, everything else kept
    assert "env_state" not in Rollout([Message("q", U)], {"env_state": object(), "a": 1}).to_dict()["metadata"]


def test_streaming_writer_and_torn_last_line(tmp_path, chatml_tokenizer):
    rollouts = _rich_rollouts(chatml_tokenizer)
    path = tmp_path / "stream.jsonl"
    with RolloutWriter(path) as w:
        w.write(rollouts[:1])
        w.write(rollouts[1:])
    assert [list(r) for r in load_rollouts(path)] == [list(r) for r in rollouts]
    with open(path, "a", encoding="utf-8") as f:  # a killed writer: half a line, no newline
        f.write(json.dumps(rollouts[0].to_dict())[:40])
    with pytest.warns(UserWarning, match="torn"):
        assert len(load_rollouts(path)) == 2
    lines = path.read_text().split("\n")
    path.write_text("\n".join([lines[0], "{not json", lines[1]]) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        load_rollouts(path)


def test_openai_message_lists_import():
    r = Rollout.from_chat([{"role": "developer", "content": "be brief"},
                           {"role": "user", "content": [{"type": "text", "text": "2+2"}, {"type": "text", "text": "?"}]},
                           {"role": "assistant", "content": None, "tool_calls": [CALL]},
                           {"role": "tool", "content": "4", "tool_call_id": "call00001"}])
    assert [m.type for m in r] == [S, U, M, T] and r[1].content == "2+2?" and r[2].content == ""
    assert r[2].tool_calls == [CALL] and r[3].tool_call_id == "call00001"
    with pytest.raises(ValueError, match="only text content parts"):
        Rollout.from_chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_replay_from_file_equals_in_memory_training(tmp_path, qwen2_model, chatml_tokenizer):
    gen = ModelGenerate(qwen2_model, chatml_tokenizer, max_new_tokens=6, temperature=1.0, seed=0)
    gen.policy_version = 5
    base = [Rollout([Message("question", U)])]
    rollouts = extend_groups(base, gen.generate(base, n=4))
    assert all(r[-1].policy_version == 5 for r in rollouts)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
    back = load_rollouts(save_rollouts(tmp_path / "replay.jsonl", rollouts))

    def loss_and_grads(rs):
        qwen2_model.zero_grad()
        loss = GRPO(qwen2_model, chatml_tokenizer, group_size=4, temperature=1.0).calculate_loss(rs, rewards)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in qwen2_model.parameters() if p.grad is not None]

    (l1, g1), (l2, g2) = loss_and_grads(rollouts), loss_and_grads(back)
    assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))


def test_staleness_metric_and_push_bumps_version(qwen2_model, chatml_tokenizer):
    gen = ModelGenerate(qwen2_model, chatml_tokenizer, max_new_tokens=4, temperature=1.0, seed=0)
    gen.policy_version = 2
    base = [Rollout([Message("q", U)])]
    rollouts = extend_groups(base, gen.generate(base, n=2))
    gen.push_weights()
    assert gen.policy_version == 3
    grpo = GRPO(qwen2_model, chatml_tokenizer, group_size=2, temperature=1.0)
    grpo.policy_version = 5
    grpo.calculate_loss(grpo.prepare(rollouts, torch.tensor([1.0, 0.0])))
    assert grpo.metrics["staleness_mean"] == 3 and grpo.metrics["staleness_max"] == 3


def _versioned(version: int) -> list[Rollout]:
    return [Rollout([Message("q", U), Message("a", M, token_ids=[1], policy_version=version)])]


def test_a_fast_producer_never_hands_out_rollouts_older_than_k():
    for k in (0, 1, 2):
        queue = RolloutQueue(max_staleness=k)
        producer = AsyncProducer(lambda step, version: _versioned(version), queue, steps=range(1, 9)).start()
        for step in range(1, 9):
            current = step - 1
            batch = queue.get(current_version=current, timeout=10)
            assert 0 <= current - batch[0][1].policy_version <= k
            time.sleep(0.01)  # a slow trainer
            producer.publish({}, version=step)
        producer.stop()
        assert queue.dropped == 0


def test_queue_drops_or_keeps_stale_batches_and_surfaces_producer_errors():
    q = RolloutQueue(max_staleness=1, maxsize=3)
    for v in (0, 3, 4):
        q.put(_versioned(v))
    assert q.get(current_version=4)[0][1].policy_version == 3 and q.dropped == 1
    keep = RolloutQueue(max_staleness=1, stale="keep")
    keep.put(_versioned(0))
    assert keep.get(current_version=5)[0][1].policy_version == 0

    def boom(step, version):
        raise RuntimeError("generator crashed")

    failing = RolloutQueue(max_staleness=1)
    AsyncProducer(boom, failing, steps=[1]).start()
    with pytest.raises(RuntimeError, match="producer failed"):
        failing.get(current_version=0, timeout=10)
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutQueue(max_staleness=-1)


def test_producer_applies_published_weights_between_batches():
    applied, seen = [], []

    def produce(step, version):
        seen.append(version)
        return _versioned(version)

    queue = RolloutQueue(max_staleness=0)
    producer = AsyncProducer(produce, queue, steps=[1, 2], apply=lambda sd: applied.append(sd["w"].item())).start()
    assert queue.get(current_version=0, timeout=10)[0][1].policy_version == 0
    producer.publish({"w": torch.tensor(7.0)}, version=1)
    assert queue.get(current_version=1, timeout=10)[0][1].policy_version == 1
    producer.stop()
    assert applied == [7.0] and seen == [0, 1]


def test_writers_create_the_folder(tmp_path):
    rollout = Rollout([Message("hi", MessageType.MESSAGE)])
    with RolloutWriter(tmp_path / "run" / "rollouts.jsonl") as w:
        w.write([rollout])
    save_rollouts(tmp_path / "other" / "step_1.jsonl", [rollout])
    assert len(load_rollouts(tmp_path / "run" / "rollouts.jsonl")) == len(load_rollouts(tmp_path / "other" / "step_1.jsonl")) == 1


# ------------------------------------------------------------------ issue 34: rollout files survive their disks


def _accented(k):
    """A rollout whose texts are full of two-byte UTF-8 characters."""
    return Rollout([Message(f"Question {k}: combien coûte le café?", U),
                    Message(f"C'est réglé: {k} é" + "é" * k, M, token_ids=[k, k + 1], logprobs=[-0.5, -0.25])],
                   {"answer": f"é{k}", "group_id": k})


def _same(loaded, expected):
    return [list(r) for r in loaded] == [list(r) for r in expected] and \
        [r.metadata for r in loaded] == [r.metadata for r in expected]


def test_a_tear_inside_a_multibyte_character_costs_only_that_line(tmp_path):
    rollouts = [_accented(k) for k in range(18)]
    path = tmp_path / "r.jsonl"
    with RolloutWriter(path) as w:
        for k in range(0, 18, 6):
            w.write(rollouts[k:k + 6])
    data = path.read_bytes()
    cut = data.rindex("é".encode()) + 1  # a full disk stopped the write between the two bytes of the last é
    path.write_bytes(data[:cut])
    with pytest.raises(UnicodeDecodeError):
        data[:cut].decode("utf-8")  # the file as a whole is not UTF-8 any more
    with pytest.warns(UserWarning, match="last line is torn"):
        assert _same(load_rollouts(path), rollouts[:17])
    # the run goes on: a new writer starts on a new line, the fragment stays a line of its own
    more = [_accented(k) for k in range(18, 21)]
    with RolloutWriter(path) as w:
        w.write(more)
    with pytest.warns(UserWarning, match="line 18 is torn"):
        assert _same(load_rollouts(path), rollouts[:17] + more)


def test_a_writer_reopened_after_a_torn_tail_starts_a_new_line_at_every_cut(tmp_path):
    """Cut the last record at every byte, reopen, write one more: every complete record loads, at any cut."""
    rollouts = [_accented(k) for k in range(3)]
    path = tmp_path / "r.jsonl"
    save_rollouts(path, rollouts)
    data = path.read_bytes()
    last_start = data.rindex(b"\n", 0, len(data) - 1) + 1
    extra = _accented(99)
    for cut in range(last_start, len(data)):  # len(data) - 1: only the newline is missing, the record is whole
        path.write_bytes(data[:cut])
        with RolloutWriter(path) as w:
            w.write([extra])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            whole = cut == len(data) - 1
            assert _same(load_rollouts(path), rollouts[:2 + whole] + [extra]), cut
        torn = [str(c.message) for c in caught]
        assert torn == ([] if cut == last_start or whole else [f"{path}: line 3 is torn (a writer was stopped mid-line, "
                                                       "a later one went on after it); skipped it"]), cut


def test_a_write_cut_by_a_full_disk_is_followed_by_a_new_line(tmp_path):
    rollouts = [_accented(k) for k in range(4)]
    path = tmp_path / "r.jsonl"

    class FullDisk:  # takes 25 bytes of the next write (ending inside an é), then the disk is full
        def __init__(self, file):
            self.file, self.full = file, False

        def write(self, data):
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.full = True
            return self.file.write(bytes(data[:25]))

        def __getattr__(self, name):
            return getattr(self.file, name)

    with RolloutWriter(path) as w:
        w.write(rollouts[:1])
        w._file = FullDisk(w._file)
        with pytest.raises(OSError, match="No space"):
            w.write(rollouts[1:2])
        w._file = w._file.file  # space freed: the loop writes on
        w.write(rollouts[2:])
    with pytest.warns(UserWarning, match="line 2 is torn"):
        assert _same(load_rollouts(path), rollouts[:1] + rollouts[2:])


def test_bad_lines_that_no_tear_explains_are_still_errors(tmp_path):
    good = [json.dumps(_accented(k).to_dict(), ensure_ascii=False).encode() for k in range(2)]
    path = tmp_path / "r.jsonl"
    path.write_bytes(good[0] + b"\n\xff\xfe" + good[1][2:] + b"\n" + good[1] + b"\n")  # not UTF-8, mid-file
    with pytest.raises(ValueError, match="line 2 is not UTF-8"):
        load_rollouts(path)
    path.write_bytes(good[0] + b"\n" + good[1][:-1] + b" 1}\n" + good[1] + b"\n")  # JSON gone wrong, not cut short
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        load_rollouts(path)
    path.write_bytes(good[0] + b"\n" + good[1][:40] + b"\n")  # cut short, yet its newline was written: not a tear
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        load_rollouts(path)
