"""The OpenAI-compatible gateway, driven by the real `openai` SDK against a live server on 127.0.0.1."""

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from transformers import AutoTokenizer  # noqa: E402

from SimpleTorchLLMRL import GRPO, collect_rollouts  # noqa: E402
from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout  # noqa: E402
from SimpleTorchLLMRL.chat.rollout_io import load_rollouts  # noqa: E402
from SimpleTorchLLMRL.chat.tokenize import encode_prompt, encode_rollout  # noqa: E402
from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402
from SimpleTorchLLMRL.gateway.chat import reply_view  # noqa: E402
from SimpleTorchLLMRL.testing.tiny import TINY_CALC  # noqa: E402
from SimpleTorchLLMRL.tools.parsers import ToolCall  # noqa: E402
from tests.support.gateway_helpers import start  # noqa: E402
from tests.support.generation_helpers import make_generator as generator_of  # noqa: E402


def make_generator(calc, env, **kw):
    model, tok = calc
    opts = dict(max_new_tokens=40, temperature=1.0, tool_call_stop=env.stop_strings, seed=0) | kw
    return generator_of(model, tok, **opts)


def run_tool(env, call) -> str:
    """The calculator's answer to an OpenAI tool call, as the env's registry gives it."""
    parsed = ToolCall(call.function.name, arguments=json.loads(call.function.arguments))
    return env.registry.execute_detailed([parsed])[0].to_message().content


def agent(client, env, messages, turns: int = 3, **kw):
    """An agent loop written only against the OpenAI SDK; returns the responses."""
    responses = []
    for _ in range(turns):
        r = client.chat.completions.create(model="policy", messages=messages, tools=env.tools,
                                           extra_body={"return_token_ids": True}, **kw)
        responses.append(r)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(env, call)})
    return responses


def sampled(rollout):
    return [m for m in rollout if m.token_ids is not None]


def test_a_tool_calling_session_is_one_rollout_of_the_returned_ids(served, env, calc):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="merge-1")
    responses = agent(client, env, start(), temperature=0)
    assert any(r.choices[0].message.tool_calls for r in responses)  # a real multi-turn tool episode
    [rollout] = gw.rollouts("merge-1")
    turns = sampled(rollout)
    assert len(turns) == len(responses) >= 2
    for r, m in zip(responses, turns, strict=True):
        assert m.token_ids == r.choices[0].model_extra["token_ids"]
        assert r.usage.completion_tokens == len(m.token_ids)
        assert m.is_trainable and m.temperature == 1.0 and m.policy_version == 0
    # each response's prompt is the rollout up to that turn, as the trainer will encode it
    enc = encode_rollout(rollout, calc[1])
    for r, m in zip(responses, turns, strict=True):
        prompt = r.model_extra["prompt_token_ids"]
        assert enc.input_ids[: len(prompt) + len(m.token_ids)] == prompt + m.token_ids
        assert r.usage.prompt_tokens == len(prompt)
    trained = [t for t, k in zip(enc.input_ids, enc.loss_mask, strict=True) if k]
    assert trained == [t for m in turns for t in m.token_ids]  # exactly the sampled ids are trained
    assert [m.type for m in rollout if m.type is MessageType.TOOL]  # the tool results are in the rollout


def test_replayed_arguments_in_another_json_spelling_still_merge(served, env):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="respell-1")
    messages = start()
    r = client.chat.completions.create(model="policy", messages=messages, tools=env.tools, temperature=0)
    msg = r.choices[0].message.model_dump(exclude_none=True)
    assert msg.get("tool_calls")
    for call in msg["tool_calls"]:  # frameworks re-serialize: no spaces, keys reordered
        args = json.loads(call["function"]["arguments"])
        call["function"]["arguments"] = json.dumps(dict(reversed(list(args.items()))), separators=(",", ":"))
    msg["content"] = None
    messages += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "31605"}]
    client.chat.completions.create(model="policy", messages=messages, tools=env.tools, temperature=0)
    [rollout] = gw.rollouts("respell-1")
    assert len(sampled(rollout)) == 2


def test_an_edited_history_forks_and_never_trains_what_was_not_sampled_there(served, env, calc):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="fork-1")
    messages = start()
    first = agent(client, env, messages, turns=1, temperature=0)
    edited = [dict(m) for m in messages]
    edited[1]["content"] = "What is 645 * 50?"  # the client rewrote an earlier message
    client.chat.completions.create(model="policy", messages=edited, tools=env.tools, temperature=0)
    rollouts = gw.rollouts("fork-1")
    assert len(rollouts) == 2
    assert sampled(rollouts[0])[0].token_ids == first[0].choices[0].model_extra["token_ids"]
    fork = rollouts[1]
    assert fork[1].content == "What is 645 * 50?"
    replayed = [m for m in fork if m.type is MessageType.MODEL and m.token_ids is None]
    assert replayed and all(not m.is_trainable for m in replayed)  # context only
    assert len(sampled(fork)) == 1
    enc = encode_rollout(fork, calc[1])
    trained = [t for t, k in zip(enc.input_ids, enc.loss_mask, strict=True) if k]
    assert trained == sampled(fork)[0].token_ids


def test_an_assistant_message_the_client_wrote_is_context(served, env):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="written-1")
    messages = start() + [{"role": "assistant", "content": "Let me think."}, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="policy", messages=messages, temperature=0)
    [rollout] = gw.rollouts("written-1")
    written = rollout[2]
    assert written.type is MessageType.MODEL and written.token_ids is None and not written.is_trainable


def test_n_choices_are_recorded_and_the_one_continued_merges(served, env):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="n-1")
    messages = start()
    r = client.chat.completions.create(model="policy", messages=messages, n=3, temperature=1.0, seed=3,
                                       extra_body={"return_token_ids": True})
    assert len(r.choices) == 3
    assert len(gw.rollouts("n-1")) == 3
    pick = r.choices[1]
    messages += [pick.message.model_dump(exclude_none=True), {"role": "user", "content": "Are you sure?"}]
    client.chat.completions.create(model="policy", messages=messages, temperature=0)
    rollouts = gw.rollouts("n-1")
    assert len(rollouts) == 3  # two finished single-turn rollouts and the continued one
    continued = [ro for ro in rollouts if len(sampled(ro)) == 2]
    assert len(continued) == 1 and sampled(continued[0])[0].token_ids == pick.model_extra["token_ids"]


def test_streaming_with_the_async_client_records_the_streamed_ids(served, env):
    gw, url = served

    async def run():
        client = openai.AsyncOpenAI(base_url=url, api_key="stream-1")
        messages = start()
        stream = await client.chat.completions.create(model="policy", messages=messages, tools=env.tools,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True},
                                                      extra_body={"return_token_ids": True})
        chunks = [c async for c in stream]
        await client.close()
        return chunks

    chunks = asyncio.run(run())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    [rollout] = gw.rollouts("stream-1")
    [turn] = sampled(rollout)
    assert finish[0].model_extra["token_ids"] == turn.token_ids
    assert usage[0].completion_tokens == len(turn.token_ids)
    content, shown = reply_view(turn.content, env.tools)
    assert text == (content or "")
    assert [c.function.name for c in calls] == [c["function"]["name"] for c in shown]


def test_logprobs_are_the_recorded_ones_and_top_logprobs_rank_them(served):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="lp-1")
    r = client.chat.completions.create(model="policy", messages=start(), temperature=0, logprobs=True,
                                       top_logprobs=3, max_tokens=8)
    [turn] = sampled(gw.rollouts("lp-1")[0])
    content = r.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(turn.logprobs, abs=1e-6)
    for e in content:  # greedy: the sampled token is the most likely one, at the recorded log-prob
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob


def test_the_session_header_names_the_session(served):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="shared-key", default_headers={"X-Session-Id": "by-header"})
    client.chat.completions.create(model="policy", messages=start(), max_tokens=4)
    assert "by-header" in gw.sessions() and "shared-key" not in gw.sessions()
    assert client.models.list().data[0].id == "policy"


def test_eight_concurrent_sessions_are_batched_and_get_their_own_answers(calc, env):
    gw = Gateway(make_generator(calc, env, max_new_tokens=24), window=0.2)
    questions = [f"What is {100 + i} * {7 + i}?" for i in range(8)]

    def one(i: int, session: str):
        client = openai.OpenAI(base_url=url, api_key=session)
        r = client.chat.completions.create(model="policy", messages=start(questions[i]), max_tokens=24,
                                           temperature=1.0, extra_body={"return_token_ids": True})
        return r

    with gw.serve() as url:
        one(0, "warm")
        t0 = time.perf_counter()
        for i in range(8):
            one(i, f"seq-{i}")
        sequential = time.perf_counter() - t0
        results = [None] * 8
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, one(i, f"conc-{i}"))) for i in range(8)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        concurrent = time.perf_counter() - t0
    assert max(gw.batcher.batches) >= 4  # requests that arrived together ran as one batch
    for i, r in enumerate(results):
        [rollout] = gw.rollouts(f"conc-{i}")
        assert rollout[1].content == questions[i]
        assert sampled(rollout)[0].token_ids == r.choices[0].model_extra["token_ids"]
        assert r.model_extra["prompt_token_ids"] == encode_prompt(Rollout(rollout.messages[:2], rollout.metadata),
                                                                  calc[1])
    assert concurrent < 0.8 * sequential, (concurrent, sequential)


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, calc):
    gw, url = served
    post = lambda body, **kw: httpx.post(f"{url}/chat/completions", timeout=60, **kw,  # noqa: E731
                                         **({"content": body} if isinstance(body, (str, bytes)) else {"json": body}))
    r = post("{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = post({"model": "policy"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post({"model": "gpt-17", "messages": start()})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    long = [{"role": "user", "content": " ".join(str(i) for i in range(3000))}]
    r = post({"model": "policy", "messages": long})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and "context is 1024 tokens" in err["message"]
    r = post({"model": "policy", "messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and "unknown role" in r.json()["error"]["message"]
    r = post({"model": "policy", "messages": start(), "temperature": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    client = openai.OpenAI(base_url=url, api_key="after-errors")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=start())
    assert client.chat.completions.create(model="policy", messages=start(), max_tokens=4).choices
    assert "after-errors" in gw.sessions()


def test_a_tool_call_that_does_not_parse_is_returned_as_text():
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    text = 'Let me see. <tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
    assert reply_view(text, tools) == (text, [])
    good = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    content, calls = reply_view("Sure. " + good, tools)
    assert content == "Sure." and json.loads(calls[0]["function"]["arguments"]) == {"expression": "2+3"}
    assert reply_view(good, None) == (good, [])  # no tools in the request: plain text


class _Slow:
    """A generator that takes `delay` seconds (a client gives up before it answers)."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, *a, **kw):
        time.sleep(self.delay)
        return self.inner.generate(*a, **kw)


def test_a_client_that_leaves_harms_nobody(calc, env):
    gw = Gateway(_Slow(make_generator(calc, env), 1.5), window=0.01)
    with gw.serve() as url:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/chat/completions", json={"model": "policy", "messages": start()},
                       headers={"Authorization": "Bearer gone"}, timeout=0.3)
        client = openai.OpenAI(base_url=url, api_key="stays")
        assert client.chat.completions.create(model="policy", messages=start(), max_tokens=4).choices
        time.sleep(1.0)
    assert gw.sessions() == ["stays"]  # the call nobody received is not recorded


def test_rollouts_through_the_gateway_train_like_collect_rollouts(calc, env):
    """Same episodes (greedy), collected by collect_rollouts and by an OpenAI-SDK agent through the gateway:
    the same ids, masks and sampled log-probs, so the same GRPO loss and gradients."""
    model, tok = calc
    questions = ["What is 645 * 49?", "What is 12 + 30?"]
    direct = []
    for q in questions:  # one question per call: the same batch shapes as the gateway's one session at a time
        direct += collect_rollouts(make_generator(calc, env, temperature=0), env, [q], [None], group_size=1)
    gw = Gateway(make_generator(calc, env, temperature=0))
    with gw.serve() as url:
        for i, q in enumerate(questions):
            agent(openai.OpenAI(base_url=url, api_key=f"eq-{i}"), env, start(q), turns=env.max_turns)
    via = [gw.rollouts(f"eq-{i}")[0] for i in range(len(questions))]
    for a, b in zip(direct, via, strict=True):
        ea, eb = encode_rollout(a, tok), encode_rollout(b, tok)
        assert ea.input_ids == eb.input_ids and ea.loss_mask == eb.loss_mask
        assert ea.sampler_logprobs == pytest.approx(eb.sampler_logprobs, nan_ok=True)
    for ro in direct + via:
        ro.metadata["group_id"] = 0
    rewards = torch.tensor([1.0, 0.0])
    out = []
    for rollouts in (direct, via):
        grpo = GRPO(model, tok, group_size=2)
        loss = grpo.calculate_loss(rollouts, rewards)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad()
    torch.testing.assert_close(out[0][0], out[1][0], rtol=0, atol=0)
    for ga, gb in zip(out[0][1], out[1][1], strict=True):
        torch.testing.assert_close(ga, gb, rtol=0, atol=0)


def test_record_to_writes_every_rollout_once(calc, env, tmp_path):
    path = tmp_path / "gateway.jsonl"
    gw = Gateway(make_generator(calc, env), record_to=path)
    with gw.serve() as url:
        # one named session: an edited history forks it (under a bare API key it would be another episode)
        client = openai.OpenAI(base_url=url, api_key="rec-1", default_headers={"X-Session-Id": "rec-1"})
        messages = start()
        agent(client, env, messages, turns=1, temperature=0)
        edited = [dict(m) for m in messages[:2]]
        edited[1]["content"] = "What is 2 + 2?"
        client.chat.completions.create(model="policy", messages=edited, temperature=0)  # forks: the first is final
        assert len(load_rollouts(path)) == 1
        live = gw.rollouts("rec-1")
    gw.close()
    saved = load_rollouts(path)
    assert len(saved) == 2
    for a, b in zip(saved, live, strict=True):
        assert [m.token_ids for m in a] == [m.token_ids for m in b] and a.metadata["session"] == "rec-1"


def test_clear_forgets_a_session(served):
    gw, url = served
    openai.OpenAI(base_url=url, api_key="clear-1").chat.completions.create(model="policy", messages=start(),
                                                                             max_tokens=4)
    assert len(gw.clear("clear-1")) == 1
    assert "clear-1" not in gw.sessions()
    with pytest.raises(KeyError, match="no session 'clear-1'"):
        gw.rollouts("clear-1")


def test_a_sampled_message_round_trip_keeps_its_fields(served):
    gw, url = served
    openai.OpenAI(base_url=url, api_key="fields-1").chat.completions.create(model="policy", messages=start(),
                                                                              max_tokens=6, temperature=0.7)
    [turn] = sampled(gw.rollouts("fields-1")[0])
    assert isinstance(turn, Message) and turn.temperature == pytest.approx(0.7)
    assert turn.finish_reason in ("stop", "length", "tool_call") and len(turn.logprobs) == len(turn.token_ids)


def test_the_command_line_serves_and_writes_its_sessions_on_sigterm(tmp_path):
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    record = tmp_path / "cli.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "SimpleTorchLLMRL.gateway", "--model", str(TINY_CALC), "--port",
                             str(port), "--record-to", str(record), "--max-new-tokens", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        line = proc.stdout.readline()
        while line and "serving" not in line:
            line = proc.stdout.readline()
        assert f"127.0.0.1:{port}/v1" in line, line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="cli-1")
        assert client.models.list().data[0].id == "policy"
        r = client.chat.completions.create(model="policy", messages=start(), extra_body={"return_token_ids": True})
        for path in ("sessions", "sessions/cli-1/finish"):  # without --admin-key: not served, like any other
            refused = httpx.request("GET" if path == "sessions" else "POST", f"http://127.0.0.1:{port}/v1/{path}",
                                    headers={"Authorization": "Bearer cli-1"}, timeout=30)
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "unknown_url"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    [saved] = load_rollouts(record)
    assert sampled(saved)[0].token_ids == r.choices[0].model_extra["token_ids"]


def test_the_agents_sdk_example_records_its_episodes():
    pytest.importorskip("agents")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "gateway_agents_sdk.py"
    spec = importlib.util.spec_from_file_location("gateway_agents_sdk", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rollouts = example.main()
    assert {r.metadata["session"] for r in rollouts} == {"agents-0", "agents-1", "agents-2"}
    tok = AutoTokenizer.from_pretrained(TINY_CALC)
    for r in rollouts:
        enc = encode_rollout(r, tok)
        trained = [t for t, k in zip(enc.input_ids, enc.loss_mask, strict=True) if k]
        assert trained and trained == [t for m in sampled(r) for t in m.token_ids]


def test_the_training_example_runs_and_its_reward_rises():
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, str(root / "examples" / "gateway_agent.py")], capture_output=True,
                       text=True, timeout=600, cwd=root)
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(r"first \d+ steps ([\d.]+), last \d+ steps ([\d.]+)", p.stdout)
    assert m, p.stdout[-2000:]
    assert float(m.group(2)) > float(m.group(1)) + 0.1, p.stdout
