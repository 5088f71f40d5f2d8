"""logprob_drift: per message / role / agent gaps between sampled and recomputed log-probs."""

import math

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import Batch, rollouts_to_batch
from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
from SimpleTorchLLMRL.trainer.drift import logprob_drift
from SimpleTorchLLMRL.trainer.grpo import GRPO

U, M = MessageType.MESSAGE, MessageType.MODEL
nan = float("nan")


def _hand_batch():
    rollouts = [Rollout([Message("q", U), Message("a", M, name="alice"), Message("q2", U), Message("b", M, name="bob")]),
                Rollout([Message("q", U), Message("a", M, name="alice")])]
    index = torch.tensor([[-1, 1, 1, -1, 3, 3], [-1, 1, 1, 1, -1, -1]])
    old = torch.tensor([[nan, -1.0, -2.0, nan, -0.5, -0.5], [nan, -0.1, -0.2, -0.3, nan, nan]])
    new = torch.tensor([[nan, -1.0, -1.5, nan, -0.5, -0.7], [nan, -0.15, -0.2, nan, nan, nan]])
    ones = torch.ones(2, 6, dtype=torch.long)
    return rollouts, Batch(torch.zeros(2, 6, dtype=torch.long), ones, ones, old, 1.0, index), new


def test_drift_matches_hand_computed_values():
    rollouts, batch, new = _hand_batch()
    rep = logprob_drift(rollouts, (batch, new))
    # |d| per token: alice row 0: 0, 0.5; bob: 0, 0.2; alice row 1: 0.05, 0 (its third token has no recomputed value)
    assert rep.overall.tokens == 6
    assert rep.overall.mean_abs == pytest.approx(0.75 / 6)
    assert rep.overall.max_abs == pytest.approx(0.5)
    assert rep.overall.frac_outside == pytest.approx(2 / 6)  # exp(0.5) > 1.1 and exp(-0.2) < 0.9
    alice, bob = rep.by_agent["alice"], rep.by_agent["bob"]
    assert (alice.tokens, bob.tokens) == (4, 2)
    assert alice.mean_abs == pytest.approx(0.55 / 4) and bob.mean_abs == pytest.approx(0.1)
    assert alice.frac_outside == pytest.approx(0.25) and bob.frac_outside == pytest.approx(0.5)
    assert set(rep.by_role) == {"assistant"} and rep.by_role["assistant"].tokens == 6
    worst = rep.worst(3)
    assert [(w.rollout, w.message) for w in worst] == [(0, 1), (0, 3), (1, 1)]
    assert worst[0].mean_abs == pytest.approx(0.25) and worst[0].name == "alice"
    assert worst[2].mean_abs == pytest.approx(0.025) and worst[2].frac_outside == 0
    s = rep.summary()
    assert s["agent/bob/mean_abs"] == pytest.approx(0.1) and s["worst_rollout"] == 0 and s["worst_message"] == 1
    assert "worst: rollout 0 message 1 (assistant alice)" in str(rep)


def test_drift_over_micro_batches_equals_one_batch():
    rollouts, batch, new = _hand_batch()
    whole = logprob_drift(rollouts, (batch, new))
    parts = logprob_drift(rollouts, [(batch[0], new[:1]), (batch[1], new[1:])])
    assert parts.summary() == whole.summary()


def test_drift_rejects_bad_input():
    rollouts, batch, new = _hand_batch()
    with pytest.raises(ValueError, match="shape"):
        logprob_drift(rollouts, (batch, new[:, :3]))
    with pytest.raises(ValueError, match="2 rows but 1 rollouts"):
        logprob_drift(rollouts[:1], (batch, new))
    with pytest.raises(ValueError, match="sampled log-probs"):
        logprob_drift(rollouts, (Batch(batch.input_ids, batch.attention_mask, batch.loss_mask), new))
    with pytest.raises(ValueError, match="band"):
        logprob_drift(rollouts, (batch, new), band=1.5)


def test_on_policy_drift_is_tiny_and_a_corrupted_turn_is_the_worst(qwen2_model, chatml_tokenizer):
    """Generator and trainer agree on the same weights; a message whose recorded log-probs were altered stands out."""
    torch.manual_seed(0)
    gen = ModelGenerate(qwen2_model, chatml_tokenizer, max_new_tokens=6, temperature=1.0, seed=0)
    rollouts = [Rollout([Message(f"question {i}", U)]) for i in range(4)]
    gen.batch_rollout_generate_response(rollouts)
    for r in rollouts:
        r.add_messages(Message("go on", U))
    gen.batch_rollout_generate_response(rollouts)
    bad = rollouts[2][3]
    bad.logprobs = [x - 0.3 for x in bad.logprobs]
    grpo = GRPO(qwen2_model, chatml_tokenizer, group_size=4, temperature=1.0)
    grpo.calculate_loss(rollouts, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    batch = rollouts_to_batch(rollouts, chatml_tokenizer)
    rep = logprob_drift(rollouts, (batch, grpo.token_logprobs.cpu()))
    sampled = sum(len(m.token_ids) for r in rollouts for m in r if m.token_ids)
    assert rep.overall.tokens == sampled  # every sampled token is trained and recomputed
    w = rep.worst(1)[0]
    assert (w.rollout, w.message) == (2, 3) and w.mean_abs == pytest.approx(0.3, abs=1e-3)
    others = [m for m in rep.messages if (m.rollout, m.message) != (2, 3)]
    assert max(m.max_abs for m in others) < 1e-3
    assert not math.isnan(rep.by_role["assistant"].mean_abs)


def test_report_hides_the_agent_table_without_names():
    rollouts, batch, new = _hand_batch()
    for r in rollouts:
        for m in r:
            m.name = None
    rep = logprob_drift(rollouts, (batch, new))
    assert not any(k.startswith("agent/") for k in rep.summary()) and " agent " not in str(rep)


@pytest.mark.slow
def test_drift_example_runs(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "drift_report.py"
    spec = importlib.util.spec_from_file_location("drift_report", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--questions", "2", "--group-size", "2"])
    out = capsys.readouterr().out
    same, shifted = out.split("2. trainer in bfloat16")
    assert "worst: rollout" in shifted and "log-prob drift over" in same
    first = lambda text: float(text.split("mean |d| ")[1].split(",")[0])  # noqa: E731
    assert first(same) < 1e-4 < first(shifted)
