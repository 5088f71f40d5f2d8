"""Multi-agent rollouts: named agents, only chosen agents trained, per-agent views, exact masks."""

import importlib.util
import math
from pathlib import Path

import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt, encode_rollout
from SimpleTorchLLMRL.env.multiagent import (
    agent_message,
    agent_turns,
    agents_in,
    render_turn,
    set_trainable_agents,
    take_turn,
    trainable_agents,
    view_for_agent,
    views_by_agent,
)


def sampled(tokenizer, text, name, lp=-0.5):
    """A MODEL turn as a generator would return it: ids (ending with EOS where a template has one) + log-probs."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.chat_template:
        ids = ids + [tokenizer.eos_token_id]
    return agent_message(text, name, token_ids=ids, logprobs=[lp] * len(ids), temperature=1.0)


def debate(tokenizer=None):
    """system, user, A, B, tool, A, C, B — with sampled ids when a tokenizer is given."""
    def turn(text, name, lp):
        return sampled(tokenizer, text, name, lp) if tokenizer is not None else agent_message(text, name)

    return Rollout([
        Message("You debate.", MessageType.SYSTEM),
        Message("Is 91 prime?"),
        turn("No: 91 = 7 * 13.", "A", -0.1),
        turn("I think it is prime.", "B", -0.2),
        Message("27", MessageType.TOOL),
        turn("Check: 7 * 13 = 91, so \\boxed{no}.", "A", -0.3),
        turn("Agreed with A.", "C", -0.4),
        turn("Fine, not prime.", "B", -0.5),
    ], metadata={"answer": "no"})


def test_agent_message_and_queries():
    m = agent_message("hi", "A")
    assert m.type is MessageType.MODEL and m.name == "A" and m.is_trainable
    with pytest.raises(ValueError, match="agent name"):
        agent_message("hi", "")
    r = debate()
    assert agents_in(r) == ["A", "B", "C"]
    assert [m.content for m in agent_turns(r, "B")] == ["I think it is prime.", "Fine, not prime."]
    assert trainable_agents(r) == {"A", "B", "C"}  # default: every MODEL turn trains


def test_set_trainable_agents_marks_exactly():
    r = debate()
    r[1].trainable = True  # a user turn explicitly trained: must stay untouched
    out = set_trainable_agents(r, {"A", "C"})
    assert out is r
    assert [m.is_trainable for m in r] == [False, True, True, False, False, True, True, False]
    assert trainable_agents(r) == {"A", "C"}
    set_trainable_agents(r, "B")
    assert [i for i, m in enumerate(r) if m.is_trainable] == [1, 3, 7]


def test_set_trainable_agents_copy_and_errors():
    r = debate()
    c = set_trainable_agents(r, ["A"], inplace=False)
    assert trainable_agents(c) == {"A"} and trainable_agents(r) == {"A", "B", "C"}
    with pytest.raises(ValueError, match=r"\['D'\] have no MODEL turn"):
        set_trainable_agents(r, {"A", "D"})
    r.add_messages(Message("anonymous", MessageType.MODEL))
    with pytest.raises(ValueError, match="no name"):
        set_trainable_agents(r, {"A"})
    set_trainable_agents(r, {"A", "D"}, strict=False)
    assert r[-1].trainable is False and trainable_agents(r) == {"A"}


def test_shared_transcript_mask_is_exactly_the_chosen_agents_tokens(any_tokenizer):
    tok = any_tokenizer
    r = set_trainable_agents(debate(tok), {"A"})
    enc = encode_rollout(r, tok)
    everyone = encode_rollout(set_trainable_agents(debate(tok), {"A", "B", "C"}), tok)
    assert enc.input_ids == everyone.input_ids  # trainability never changes the ids
    masked = [t for t, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m]
    assert masked == [t for m in agent_turns(r, "A") for t in m.token_ids]
    # masked positions carry A's sampled log-probs; B's and C's sampled tokens are context (logprobs kept, mask 0)
    masked_lp = [lp for lp, m in zip(enc.sampler_logprobs, enc.loss_mask, strict=True) if m]
    assert masked_lp == [-0.1] * len(agent_turns(r, "A")[0].token_ids) + [-0.3] * len(agent_turns(r, "A")[1].token_ids)
    n_sampled = sum(len(m.token_ids) for m in r if m.token_ids)
    assert sum(not math.isnan(x) for x in enc.sampler_logprobs) == n_sampled


def test_shared_transcript_text_turns(any_tokenizer):
    """Turns without sampled ids: the mask covers the chosen agent's content (+ its end-of-turn token)."""
    tok = any_tokenizer
    r = set_trainable_agents(debate(), {"B"})
    enc = encode_rollout(r, tok)
    eot = 1  # chatml/llama3: the end-of-turn special; plain: the appended EOS
    expected = sum(len(tok(m.content, add_special_tokens=False)["input_ids"]) + eot for m in agent_turns(r, "B"))
    assert sum(enc.loss_mask) == expected
    assert sum(encode_rollout(set_trainable_agents(debate(), {"A", "B"}), tok).loss_mask) > expected


def test_view_for_agent_structure():
    r = debate()
    v = view_for_agent(r, "A")
    assert [m.type for m in v] == [MessageType.SYSTEM, MessageType.MESSAGE, MessageType.MODEL, MessageType.MESSAGE,
                                   MessageType.TOOL, MessageType.MODEL, MessageType.MESSAGE, MessageType.MESSAGE]
    assert v[3].content == "[B]: I think it is prime." and v[6].content == "[C]: Agreed with A."
    assert [m.is_trainable for m in v] == [False, False, True, False, False, True, False, False]
    assert v.metadata == {"answer": "no", "agent": "A"} and "agent" not in r.metadata
    assert [m.type for m in r].count(MessageType.MODEL) == 5  # the original is untouched
    frozen = view_for_agent(r, "B", template="{name} said: {content}", train=False)
    assert frozen[2].content == "A said: No: 91 = 7 * 13." and not any(m.is_trainable for m in frozen)
    assert set(views_by_agent(r)) == {"A", "B", "C"}
    assert render_turn(Message("x", MessageType.MODEL)) == "[agent]: x"
    with pytest.raises(ValueError, match="as_type"):
        view_for_agent(r, "A", as_type=MessageType.MODEL)


def test_view_keeps_own_sampled_tokens_and_masks_only_them(any_tokenizer):
    tok = any_tokenizer
    r = debate(tok)
    for agent in ("A", "B"):
        v = view_for_agent(r, agent)
        own = agent_turns(r, agent)
        assert [m.token_ids for m in agent_turns(v, agent)] == [m.token_ids for m in own]
        assert [m.logprobs for m in agent_turns(v, agent)] == [m.logprobs for m in own]
        enc = encode_rollout(v, tok)
        assert [t for t, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m] == [t for m in own for t in m.token_ids]
        assert sum(not math.isnan(x) for x in enc.sampler_logprobs) == sum(len(m.token_ids) for m in own)


def test_take_turn_prefix_invariant(any_tokenizer):
    """Ids a speaker was prompted with + its sampled ids are a prefix of its view after the turn."""
    tok = any_tokenizer
    r = Rollout([Message("You debate.", MessageType.SYSTEM), Message("Is 91 prime?")])
    seen = {}

    def respond_as(agent, text):
        def respond(view):
            assert view.metadata["agent"] == agent
            seen[agent] = encode_prompt(view, tok)
            return sampled(tok, text, name="ignored")
        return respond

    for agent, text in [("A", "No, 7 * 13."), ("B", "Yes it is."), ("A", "It is \\boxed{no}.")]:
        reply = take_turn(r, agent, respond_as(agent, text))
        assert reply.name == agent and reply.type is MessageType.MODEL and r[-1] is reply
        after = encode_rollout(view_for_agent(r, agent), tok).input_ids
        assert after[: len(seen[agent]) + len(reply.token_ids)] == seen[agent] + reply.token_ids
    assert [m.name for m in r if m.type is MessageType.MODEL] == ["A", "B", "A"]
    # B saw A's first turn as a user message, not as its own
    assert "[A]: No, 7 * 13." in tok.decode(seen["B"])
    with pytest.raises(TypeError, match="Message"):
        take_turn(r, "A", lambda view: "not a message")


@pytest.mark.slow
def test_example_script_trains_only_agent_a():
    path = Path(__file__).resolve().parents[2] / "examples" / "multi_agent.py"
    spec = importlib.util.spec_from_file_location("multi_agent_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(num_debates=2, rounds=1, max_new_tokens=6)
    assert out["a_tokens_in_mask"] > 0 and out["b_tokens_sampled"] > 0
    assert out["max_logprob_diff"] < 1e-4  # A's view reproduces the sampling context exactly
    assert math.isfinite(out["loss"]) and out["grad_norm"] > 0
