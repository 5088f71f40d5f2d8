"""The gateway's limits (body size, prompt length, nesting, seeds, messages) and named agents merging,
driven over 127.0.0.1 by the real `openai` SDK and raw httpx requests."""

import json
import time

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


from SimpleTorchLLMRL import ModelGenerate  # noqa: E402
from SimpleTorchLLMRL.chat.tokenize import encode_rollout  # noqa: E402
from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402
from SimpleTorchLLMRL.gateway import server as gateway_server  # noqa: E402
from SimpleTorchLLMRL.recipes.calculator.arithmetic import CALCULATOR_SCHEMA  # noqa: E402
from tests.support.gateway_helpers import load_calc, start  # noqa: E402

MiB = 1024 * 1024
TOOLS = [CALCULATOR_SCHEMA]


@pytest.fixture(scope="module")
def generator():
    model, tok = load_calc()
    return ModelGenerate(model, tok, max_new_tokens=40, temperature=1.0, tool_call_stop=["</tool_call>"], seed=0)


def post(url: str, body, timeout: float = 30, **kw) -> httpx.Response:
    data = {"content": body} if isinstance(body, (str, bytes)) or hasattr(body, "__next__") else {"json": body}
    return httpx.post(f"{url}/chat/completions", timeout=timeout, **data, **kw)


def sampled(rollout):
    return [m for m in rollout if m.token_ids is not None]


# ----------------------------------------------------------------------------- named agents


def replayed(message, name: str) -> dict:
    """The reply as LangGraph / langchain agents send it back: the agent's name, the SDK's null fields."""
    out = message.model_dump()  # refusal / audio / function_call: None, as the SDK parsed them
    out.update(name=name, annotations=[], refusal=None, audio=None, function_call=None)
    if not out.get("tool_calls"):
        out["tool_calls"] = []
    return out


def next_turn(messages: list[dict], reply: dict) -> list[dict]:
    messages = [*messages, reply]
    if reply["tool_calls"]:
        return messages + [{"role": "tool", "tool_call_id": c["id"], "content": "31605"} for c in reply["tool_calls"]]
    return messages + [{"role": "user", "content": "Go on."}]


def test_a_named_agent_replaying_its_reply_is_one_rollout_of_the_exact_ids(served, generator):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="named-1")
    ask = dict(model="policy", tools=TOOLS, temperature=0, extra_body={"return_token_ids": True})
    messages = start()
    first = client.chat.completions.create(messages=messages, **ask)
    messages = next_turn(messages, replayed(first.choices[0].message, "researcher"))
    second = client.chat.completions.create(messages=messages, **ask)
    [rollout] = gw.rollouts("named-1")  # merged: the name and null fields did not fork the episode
    turns = sampled(rollout)
    assert [m.token_ids for m in turns] == [r.choices[0].model_extra["token_ids"] for r in (first, second)]
    assert turns[0].name == "researcher" and turns[0].is_trainable
    enc = encode_rollout(rollout, generator.tokenizer)  # the turn was not re-rendered for the second call
    prompt = second.model_extra["prompt_token_ids"]
    assert enc.input_ids[: len(prompt) + len(turns[1].token_ids)] == prompt + turns[1].token_ids


def test_an_edited_named_reply_still_forks(served):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="named-edit")
    messages = start()
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=0)
    reply = replayed(first.choices[0].message, "researcher")
    reply["content"] = (reply["content"] or "") + " (edited)"
    client.chat.completions.create(model="policy", messages=next_turn(messages, reply), tools=TOOLS, temperature=0)
    rollouts = gw.rollouts("named-edit")
    assert len(rollouts) == 2
    edited = [m for m in rollouts[1] if m.role == "assistant" and m.token_ids is None]
    assert edited[0].name == "researcher" and not edited[0].is_trainable


# ----------------------------------------------------------------------------- limits


def huge_body(size: int) -> bytes:
    return json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x" * size}]}).encode()


def test_a_50_mb_body_is_refused_at_once_with_413(served):
    gw, url = served
    body = huge_body(50 * MiB)
    t = time.monotonic()
    r = post(url, body, timeout=10)
    elapsed = time.monotonic() - t
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and str(gw.max_body_bytes) in err["message"]
    assert elapsed < 2, f"refusing a 50 MB body took {elapsed:.1f} s"


def test_a_chunked_body_is_cut_off_at_the_limit(served):
    _, url = served
    sent = []

    def chunks():  # no Content-Length: the server must count
        for _ in range(50):
            sent.append(MiB)
            yield b"x" * MiB

    t = time.monotonic()
    try:
        r = post(url, chunks(), timeout=10)
    except httpx.TransportError:  # the server may close the connection before the client finishes sending
        r = None
    assert time.monotonic() - t < 2
    assert r is None or r.status_code == 413
    assert sum(sent) < 50 * MiB  # the server stopped reading long before the end


def test_the_body_limit_is_a_keyword_and_a_flag(generator):
    from SimpleTorchLLMRL.gateway.__main__ import parse_args

    assert parse_args(["--model", "m", "--max-body-bytes", "1000"]).max_body_bytes == 1000
    with pytest.raises(ValueError, match="max_body_bytes"):
        Gateway(generator, max_body_bytes=0)
    gw = Gateway(generator, max_body_bytes=2000)
    with gw.serve() as url:
        client = openai.OpenAI(base_url=url, api_key="small")
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "y" * 3000}])
        assert e.value.status_code == 413
        assert client.chat.completions.create(model="policy", messages=start(), max_tokens=4).choices


def test_a_prompt_far_past_the_context_is_refused_before_tokenizing(served, monkeypatch):
    _, url = served
    calls = []
    encode = gateway_server.encode_prompt
    monkeypatch.setattr(gateway_server, "encode_prompt", lambda *a: calls.append(1) or encode(*a))
    r = post(url, huge_body(3 * MiB))  # under the body limit, far past 1024 tokens
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert calls == []  # no tokenization was spent on it


def test_deeply_nested_json_is_a_400(served):
    _, url = served
    r = post(url, "[" * 100_000)
    assert r.status_code == 400 and "nests" in r.json()["error"]["message"]
    deep = {"model": "policy", "messages": start(), "chat_template_kwargs": {"x": json.loads("[" * 500 + "]" * 500)}}
    r = post(url, json.dumps(deep))
    assert r.status_code == 400 and "nests" in r.json()["error"]["message"]


def test_a_seed_beyond_64_bits_is_a_400_naming_it(served):
    _, url = served
    r = post(url, {"model": "policy", "messages": start(), "seed": 2**70, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    assert post(url, {"model": "policy", "messages": start(), "seed": 2**63 - 1, "max_tokens": 2}).status_code == 200


def test_empty_messages_and_missing_content_are_400s_naming_them(served):
    _, url = served
    r = post(url, {"model": "policy", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(url, {"model": "policy", "messages": [{"role": "system", "content": "hi"}, {"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content"
    r = post(url, {"model": "policy", "messages": [*start(), {"role": "assistant", "content": None}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[2].content"


def test_after_the_refusals_a_normal_request_still_works(served):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="normal-after")
    r = client.chat.completions.create(model="policy", messages=start(), tools=TOOLS, max_tokens=8)
    assert r.choices and r.usage.completion_tokens >= 1
    assert "normal-after" in gw.sessions()
