import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout


def test_roles_and_default_trainable():
    assert [t.role for t in MessageType] == ["system", "user", "assistant", "tool"]
    assert Message("x", MessageType.MODEL).is_trainable
    for t in (MessageType.SYSTEM, MessageType.MESSAGE, MessageType.TOOL):
        assert not Message("x", t).is_trainable
    assert not Message("x", MessageType.MODEL, trainable=False).is_trainable
    assert Message("x", MessageType.MESSAGE, trainable=True).is_trainable


def test_role_strings_accepted_and_unknown_role_rejected():
    assert Message("x", "assistant").type is MessageType.MODEL
    assert Message("x", "MODEL").type is MessageType.MODEL
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        Message("x", "robot")


def test_rollout_container_protocol():
    r = Rollout()
    a, b = Message("hi"), Message("yo", MessageType.MODEL)
    assert r.add_messages(a, b) is r
    assert len(r) == 2 and r[0] is a and r[-1] is b and list(r) == [a, b] and r.messages == [a, b]
    assert r[0:1] == [a]
    assert r.metadata == {}


def test_add_non_message_names_the_problem():
    with pytest.raises(TypeError, match="argument 1 is a str, not a Message"):
        Rollout().add_messages(Message("ok"), "not a message")


def test_to_chat_includes_name_only_when_set():
    r = Rollout([Message("sys", MessageType.SYSTEM), Message("a", MessageType.MODEL, name="alice")])
    assert r.to_chat() == [
        {"role": "system", "content": "sys"},
        {"role": "assistant", "content": "a", "name": "alice"},
    ]


def test_copy_is_deep():
    r = Rollout([Message("q"), Message("a", MessageType.MODEL, token_ids=[1, 2], logprobs=[-0.1, -0.2])],
                metadata={"answer": [1]})
    c = r.copy()
    c.add_messages(Message("more"))
    c[1].token_ids.append(3)
    c.metadata["answer"].append(2)
    assert len(r) == 2 and r[1].token_ids == [1, 2] and r.metadata == {"answer": [1]}


def test_token_ids_and_logprobs_must_match():
    with pytest.raises(ValueError, match="2 ids vs 1 logprobs"):
        Message("a", MessageType.MODEL, token_ids=[1, 2], logprobs=[-0.5])
    with pytest.raises(ValueError, match="without token_ids"):
        Message("a", MessageType.MODEL, logprobs=[-0.5])
    with pytest.raises(ValueError, match="log-probabilities"):
        Message("a", MessageType.MODEL, token_ids=[1], logprobs=[0.7])


def test_bad_finish_reason_and_content():
    with pytest.raises(ValueError, match="finish_reason"):
        Message("a", MessageType.MODEL, finish_reason="done")
    with pytest.raises(TypeError, match="content must be a str"):
        Message(None)


def test_from_chat_roundtrip_and_prompt_messages():
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]
    r = Rollout.from_chat(chat, answer="42")
    assert r.to_chat() == chat and r.metadata == {"answer": "42"}
    assert [m.content for m in r.prompt_messages] == ["s", "u"]
    assert r.last(MessageType.MODEL).content == "a" and r.last().content == "t"
    with pytest.raises(ValueError, match="chat turn 0 needs a 'role' key"):
        Rollout.from_chat([{"content": "x"}])


def test_user_is_the_message_member_under_another_name(tmp_path):
    from SimpleTorchLLMRL.chat.rollout_io import load_rollouts, save_rollouts

    assert MessageType.USER is MessageType.MESSAGE and MessageType["USER"] is MessageType.MESSAGE
    assert [m.name for m in MessageType] == ["SYSTEM", "MESSAGE", "MODEL", "TOOL"]  # no fifth member
    assert MessageType.from_role("USER") is MessageType.from_role("user") is MessageType.MESSAGE
    seed = Rollout([Message("hi", MessageType.MESSAGE)])
    user = Rollout([Message("hi", MessageType.USER)])
    assert user.to_chat() == seed.to_chat() == [{"role": "user", "content": "hi"}]
    assert user.to_dict() == seed.to_dict()
    save_rollouts(tmp_path / "user.jsonl", [user])
    save_rollouts(tmp_path / "seed.jsonl", [seed])
    assert (tmp_path / "user.jsonl").read_bytes() == (tmp_path / "seed.jsonl").read_bytes()
    [back] = load_rollouts(tmp_path / "user.jsonl")
    assert back[0].type is MessageType.USER and not back[0].is_trainable
