"""Gateway sessions: calls under one API key matched to episodes by prefix, idle sessions finished
after a TTL, an open-session cap (LRU), and the CLI flags. The real `openai` SDK on 127.0.0.1."""

import threading
import time
from collections import Counter

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


from SimpleTorchLLMRL.chat.message import MessageType  # noqa: E402
from SimpleTorchLLMRL.chat.rollout_io import load_rollouts  # noqa: E402
from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402
from SimpleTorchLLMRL.testing.tiny import TINY_CALC  # noqa: E402
from tests.support.gateway_helpers import start  # noqa: E402
from tests.support.generation_helpers import make_generator as generator_of  # noqa: E402


def make_generator(calc, **kw):
    model, tok = calc
    return generator_of(model, tok, **(dict(max_new_tokens=12, temperature=1.0, seed=0) | kw))


def ask(client, messages, **kw):
    return client.chat.completions.create(model="policy", messages=messages, max_tokens=12,
                                          extra_body={"return_token_ids": True}, **kw)


def ids(response) -> tuple[int, ...]:
    return tuple(response.choices[0].model_extra["token_ids"])


def turn(messages, response, follow_up: str = "Are you sure?"):
    """The next call's messages: the reply as the client was shown it, then a new user message."""
    return [*messages, response.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": follow_up}]


def sampled(rollout) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(m.token_ids) for m in rollout if m.token_ids is not None)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_concurrent_episodes_under_one_api_key_are_one_rollout_each(calc, temperature):
    """8 two-turn episodes at once under one key (an OPENAI_API_KEY set once), two of each question, as a
    GRPO group would send them: 8 rollouts, each exactly the two turns one episode was answered with.
    Greedy, the two episodes of a question are identical calls: each still joins a session of its own."""
    gw = Gateway(make_generator(calc, temperature=temperature), window=0.1)
    questions = [f"What is {100 + i} * {7 + i}?" for i in range(4)] * 2
    episodes: list = [None] * 8
    barrier = threading.Barrier(8, timeout=60)

    def episode(i: int, url: str):
        client = openai.OpenAI(base_url=url, api_key="one-key-for-all")
        messages = start(questions[i])
        barrier.wait()
        first = ask(client, messages)
        second = ask(client, turn(messages, first))
        episodes[i] = (ids(first), ids(second))

    with gw.serve() as url:
        threads = [threading.Thread(target=episode, args=(i, url)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert all(e is not None for e in episodes)
    rollouts = gw.rollouts("one-key-for-all")
    assert len(rollouts) == 8
    assert Counter(sampled(r) for r in rollouts) == Counter(episodes)
    for r in rollouts:
        assert r[1].content in questions and r.metadata["session"] == "one-key-for-all"
    assert gw.sessions() == ["one-key-for-all"] and len(gw.store) == 8
    assert max(gw.batcher.batches) >= 2  # the episodes under one key are no longer run one at a time


def test_a_new_episode_under_a_key_closes_nothing_and_each_continues(calc, tmp_path):
    """Interleaved: episode A's first turn, B's first turn, then A's and B's second turns."""
    path = tmp_path / "r.jsonl"
    gw = Gateway(make_generator(calc, temperature=0), record_to=path)
    with gw.serve() as url:
        client = openai.OpenAI(base_url=url, api_key="k")
        a, b = start("What is 2 + 2?"), start("What is 3 + 5?")
        a1, b1 = ask(client, a), ask(client, b)
        a2, b2 = ask(client, turn(a, a1)), ask(client, turn(b, b1))
        assert not path.exists() or load_rollouts(path) == []  # nothing closed: both still open
        rollouts = gw.rollouts("k")
    gw.close()
    assert [sampled(r) for r in rollouts] == [(ids(a1), ids(a2)), (ids(b1), ids(b2))]
    assert [sampled(r) for r in load_rollouts(path)] == [(ids(a1), ids(a2)), (ids(b1), ids(b2))]


def test_x_session_id_keeps_one_session_that_forks(calc, tmp_path):
    """With X-Session-Id the session is named explicitly: a call that does not extend it forks (closes it)."""
    path = tmp_path / "r.jsonl"
    gw = Gateway(make_generator(calc, temperature=0), record_to=path)
    with gw.serve() as url:
        client = openai.OpenAI(base_url=url, api_key="k", default_headers={"X-Session-Id": "named"})
        r1 = ask(client, start("What is 2 + 2?"))
        ask(client, start("What is 2 + 3?"))
        [saved] = load_rollouts(path)  # the fork closed the first episode at once
        assert sampled(saved) == (ids(r1),)
        assert len(gw.rollouts("named")) == 2 and len(gw.store) == 1
    gw.close()


def test_an_idle_session_is_finished_after_the_ttl_fake_clock(calc, tmp_path):
    path = tmp_path / "r.jsonl"
    clock = FakeClock()
    gw = Gateway(make_generator(calc, temperature=0), record_to=path, session_ttl=30, clock=clock)
    with gw.serve() as url:
        client = openai.OpenAI(base_url=url, api_key="ttl")
        old = start("What is 2 + 2?")
        o1 = ask(client, old)
        clock.now += 20
        fresh = ask(client, start("What is 7 + 1?"))
        clock.now += 20  # the first is idle 40 s, the second 20 s
        assert gw.store.expire() == 1
        [saved] = load_rollouts(path)
        assert sampled(saved) == (ids(o1),) and saved.metadata["session"] == "ttl"
        assert len(gw.store) == 1
        assert [sampled(r) for r in gw.rollouts("ttl")] == [(ids(fresh),)]
        clock.now += 31
        assert gw.store.expire() == 1 and len(gw.store) == 0 and gw.sessions() == []
        # the client continues the expired episode: a new session, the replayed reply is context
        ask(client, turn(old, o1))
        [cont] = gw.rollouts("ttl")
        replayed = [m for m in cont if m.token_ids is None and m.type is MessageType.MODEL]
        assert replayed and not any(m.is_trainable for m in replayed)
    gw.close()
    assert len(load_rollouts(path)) == 3


def test_an_idle_session_is_finished_after_the_ttl_with_no_further_calls(calc, tmp_path):
    """Real time: the server's sweeper finishes it, no call needed (bounded wait)."""
    path = tmp_path / "r.jsonl"
    gw = Gateway(make_generator(calc, temperature=0), record_to=path, session_ttl=0.3)
    with gw.serve() as url:
        r = ask(openai.OpenAI(base_url=url, api_key="sweep"), start("What is 2 + 2?"))
        deadline = time.monotonic() + 10
        while (len(gw.store) or not path.exists() or not load_rollouts(path)) and time.monotonic() < deadline:
            time.sleep(0.05)  # the session leaves the store, then its rollouts reach the file (the sweeper's thread)
        assert len(gw.store) == 0 and gw.sessions() == []
        [saved] = load_rollouts(path)
        assert sampled(saved) == (ids(r),)
    gw.close()
    assert len(load_rollouts(path)) == 1  # written once


def test_past_the_cap_the_least_recently_used_session_is_finished(calc, tmp_path):
    path = tmp_path / "r.jsonl"
    gw = Gateway(make_generator(calc, temperature=0), record_to=path, max_sessions=2)
    with gw.serve() as url:
        client = openai.OpenAI(base_url=url, api_key="cap")
        a, b, c = start("What is 1 + 1?"), start("What is 2 + 2?"), start("What is 3 + 3?")
        a1 = ask(client, a)
        b1 = ask(client, b)
        a2 = ask(client, turn(a, a1))  # A is now the most recently used
        assert not path.exists() or load_rollouts(path) == []
        c1 = ask(client, c)  # a third session: B, the least recently used, is finished
        [saved] = load_rollouts(path)
        assert sampled(saved) == (ids(b1),)
        assert len(gw.store) == 2
        assert [sampled(r) for r in gw.rollouts("cap")] == [(ids(a1), ids(a2)), (ids(c1),)]
        # X-Session-Id sessions count too: the LRU (A) goes
        named = openai.OpenAI(base_url=url, api_key="cap", default_headers={"X-Session-Id": "n"})
        ask(named, start("What is 4 + 4?"))
        assert [sampled(r) for r in load_rollouts(path)] == [(ids(b1),), (ids(a1), ids(a2))]
    gw.close()
    assert len(load_rollouts(path)) == 4  # every rollout written once


def test_the_store_rejects_bad_limits(calc):
    with pytest.raises(ValueError, match="ttl"):
        Gateway(make_generator(calc), session_ttl=0)
    with pytest.raises(ValueError, match="max_sessions"):
        Gateway(make_generator(calc), max_sessions=0)


def test_the_command_line_has_batch_and_session_flags(monkeypatch):
    from SimpleTorchLLMRL.gateway import __main__ as cli

    a = cli.parse_args(["--model", "m", "--window", "0.05", "--max-batch", "32", "--session-ttl", "60",
                        "--max-sessions", "100"])
    assert (a.window, a.max_batch, a.session_ttl, a.max_sessions) == (0.05, 32, 60.0, 100)
    d = cli.parse_args(["--model", "m"])
    assert (d.window, d.max_batch, d.session_ttl, d.max_sessions) == (0.02, 64, 600.0, 10000)
    for bad in (["--max-batch", "0"], ["--window", "-1"], ["--max-sessions", "-2"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["--model", "m", *bad])

    seen = {}

    class Stop(Exception):
        pass

    class FakeGateway:
        def __init__(self, generator, **kw):
            seen.update(kw)
            raise Stop

    import SimpleTorchLLMRL.gateway as pkg

    monkeypatch.setattr(pkg, "Gateway", FakeGateway)
    with pytest.raises(Stop):
        cli.main(["--model", str(TINY_CALC), "--window", "0.05", "--max-batch", "32", "--session-ttl", "0",
                  "--max-sessions", "7"])
    assert (seen["window"], seen["max_batch"], seen["session_ttl"], seen["max_sessions"]) == (0.05, 32, None, 7)
