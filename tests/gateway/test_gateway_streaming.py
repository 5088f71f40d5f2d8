"""Token-by-token streaming: the decode loops hand each step's ids to a `DecodeWatch`, the gateway shows them as
text deltas while the rows still sample, and a streamed call records exactly what the same call records
without streaming. Both HF loops (the fast decode runs eagerly on CPU). Servers on 127.0.0.1."""

import json
import threading

import httpx
import pytest

pytest.importorskip("fastapi")

from SimpleTorchLLMRL import ModelGenerate  # noqa: E402
from SimpleTorchLLMRL.chat.message import MessageType, Rollout  # noqa: E402
from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402
from SimpleTorchLLMRL.gateway.chat import held_suffix, reply_view, tool_openings  # noqa: E402
from SimpleTorchLLMRL.gateway.streaming import RowText  # noqa: E402
from SimpleTorchLLMRL.model.generation.fast_decode import STREAM_EVERY  # noqa: E402
from SimpleTorchLLMRL.model.generation.generator import BackendConfig
from SimpleTorchLLMRL.model.generation.sampling import (
    DecodeWatch,  # noqa: E402
    SamplingConfig,  # noqa: E402
)
from SimpleTorchLLMRL.tools.parsers import JsonToolCallParser  # noqa: E402
from tests.support.gateway_helpers import start  # noqa: E402

DECODES = ("default", "fast")
NEVER = 10**6  # an EOS id no step can sample: replies run to max_tokens


class StepCounter:
    """Counts the model's forwards (one per decode step after the prefill); `hold_at`: the forward of that
    number waits (up to 60 s) for `release`, so a test can see what went out while the generation runs."""

    def __init__(self, model, hold_at: int | None = None):
        self.count, self.hold_at = 0, hold_at
        self.release, self.held = threading.Event(), threading.Event()
        self.released_in_time = None
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1
        if self.hold_at is not None and self.count == self.hold_at:
            self.held.set()
            self.released_in_time = self.release.wait(60)

    def remove(self) -> None:
        self.release.set()
        self._handle.remove()


# ----------------------------------------------------------------------------- the decode loops


@pytest.mark.parametrize("decode", DECODES)
def test_the_watch_gets_each_rows_ids_while_it_samples_and_they_are_the_recorded_ones(calc, decode):
    model, tok = calc
    gen = ModelGenerate(model, tok,
                        sampling=SamplingConfig(max_new_tokens=24, temperature=1.0, eos_token_ids=[NEVER]),
                        backend=BackendConfig(decode=decode))
    rollouts = [Rollout.from_chat(start("What is 2 + 2?")), Rollout.from_chat(start())]
    seen: dict[int, list[int]] = {}
    deliveries: list[int] = []  # the forward count at each delivery
    steps = StepCounter(model)

    def on_tokens(rows, ids):
        deliveries.append(steps.count)
        for r, new in zip(rows, ids, strict=True):
            seen.setdefault(r, []).extend(new)

    try:
        watched = gen.generate(rollouts, 2, seed=5, watch=DecodeWatch(on_tokens))
        total = steps.count
        plain = gen.generate(rollouts, 2, seed=5)
    finally:
        steps.remove()
    flat = [m for group in watched for m in group]
    assert [m.token_ids for m in flat] == [m.token_ids for group in plain for m in group]  # the watch changes nothing
    assert all(len(m.token_ids) == 24 for m in flat)
    assert {r: ids for r, ids in seen.items()} == {r: m.token_ids for r, m in enumerate(flat)}  # row i*n + j
    every = 1 if decode == "default" else STREAM_EVERY
    assert len(deliveries) == 24 // every and deliveries[0] < total  # the first ids left long before the end
    assert deliveries[0] <= 1 + every  # the prefill, then at most `every` steps


def test_generate_takes_the_encoded_prompt_once(calc):
    """The gateway encodes each prompt; `generate(prompt_ids=...)` samples from those ids, not re-encoding."""
    model, tok = calc
    gen = ModelGenerate(model, tok, max_new_tokens=6, temperature=1.0)
    rollout = Rollout.from_chat(start())
    from SimpleTorchLLMRL.chat.tokenize import encode_prompt

    ids = encode_prompt(rollout, tok)
    [[a]] = gen.generate([rollout], seed=1)
    [[b]] = gen.generate([rollout], seed=1, prompt_ids=[ids])
    assert a.token_ids == b.token_ids
    other = encode_prompt(Rollout.from_chat(start("What is 1 + 1?")), tok)
    [[c]] = gen.generate([rollout], seed=1, prompt_ids=[other])  # the ids are what is sampled from
    [[d]] = gen.generate([Rollout.from_chat(start("What is 1 + 1?"))], seed=1)
    assert c.token_ids == d.token_ids
    with pytest.raises(ValueError, match="prompt_ids has 2 prompts for 1 rollouts"):
        gen.generate([rollout], prompt_ids=[ids, ids])


# ----------------------------------------------------------------------------- text deltas


def feed_all(row: RowText, ids, step: int = 1) -> list[str]:
    return [row.feed(ids[k:k + step]) for k in range(0, len(ids), step)]


def test_row_text_never_shows_half_a_character_and_ends_at_eos(calc):
    _, tok = calc
    ids = tok.encode("héllo 😀 wörld")
    row = RowText(tok, SamplingConfig(max_new_tokens=100, eos_token_ids=(2,)))
    parts = feed_all(row, ids + [2] + tok.encode(" after"))
    assert "".join(parts) == "héllo 😀 wörld" and "\ufffd" not in "".join(parts)
    assert parts.count("") >= 4  # the bytes of é, 😀 and ö waited for the rest of their character
    assert row.done and row.ids[-1] == 2


def test_row_text_holds_back_a_stop_string_until_it_is_decided(calc):
    _, tok = calc
    cfg = SamplingConfig(max_new_tokens=100, stop=("STOP",), eos_token_ids=(2,))
    row = RowText(tok, cfg)
    shown = "".join(feed_all(row, tok.encode("one ST two STOP three")))
    assert shown == "one ST two STOP" and row.done  # through the stop, as cut_sample cuts the text
    row = RowText(tok, cfg)
    parts = feed_all(row, tok.encode("one ST"))
    assert "".join(parts) == "one " and not row.done  # "ST" may still become "STOP"
    assert row.rest("one ST") == "ST"


def test_row_text_with_tools_holds_the_call_for_the_tool_calls_delta(calc):
    _, tok = calc
    cfg = SamplingConfig(max_new_tokens=200, eos_token_ids=(2,))
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "645*49"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    row = RowText(tok, cfg, tool_openings(None))
    shown = "".join(feed_all(row, tok.encode(text)))
    content, calls = reply_view(text, tools)
    assert shown == "Let me compute." == content and calls  # the call never went out as content
    assert row.rest(content) == ""
    assert RowText(tok, cfg, None).feed(tok.encode("hi there")) == ""  # an unknown parser: all at the end
    assert tool_openings([JsonToolCallParser("<call>", "</call>")]) == ("<call>",)
    assert held_suffix("abc <tool_", ("<tool_call>",)) == 6 and held_suffix("abc", ("<tool_call>",)) == 0


def test_reply_view_shows_each_call_as_to_openai_gives_it_with_json_arguments():
    text = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6×7"}}\n</tool_call>'
            '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    content, calls = reply_view(text, tools)
    assert content is None and [c["id"][:5] for c in calls] == ["call_", "call_"] and calls[0]["id"] != calls[1]["id"]
    assert [{k: v for k, v in c.items() if k != "id"} for c in calls] == [
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6×7"}'}},
        {"type": "function", "function": {"name": "noop", "arguments": "{}"}}]


# ----------------------------------------------------------------------------- over HTTP


def gateway(calc, env, decode: str, eos=None, **kw) -> Gateway:
    """eos: the EOS ids (e.g. [NEVER]: without them and without the tool-call stop, replies run to max_tokens)."""
    model, tok = calc
    gen = ModelGenerate(model, tok, seed=0,
                        sampling=SamplingConfig(max_new_tokens=40, temperature=1.0, eos_token_ids=eos,
                                                tool_call_stop=env.stop_strings if eos is None else None),
                        backend=BackendConfig(decode=decode))
    return Gateway(gen, **kw)


def sse_chunks(lines) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


def content_of(chunks: list[dict], index: int = 0) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"] and c["choices"][0]["index"] == index)


def model_turns(gw: Gateway, key: str) -> list:
    return [m for r in gw.rollouts(key) for m in r if m.type is MessageType.MODEL]


@pytest.mark.parametrize("decode", DECODES)
def test_headers_and_the_first_chunk_go_out_while_the_generation_runs(calc, env, decode):
    """The generation is held at its 12th step until the client has read a content chunk: a stream sent
    after the generation ended would never release it (the hold then times out and the test fails)."""
    model, _ = calc
    gw = gateway(calc, env, decode, eos=[NEVER])  # 40 tokens, always
    body = {"model": "policy", "messages": [{"role": "user", "content": "Count to twenty."}], "stream": True,
            "max_tokens": 40, "seed": 3, "stop": ["never-sampled-stop"]}
    with gw.serve() as url:
        steps = StepCounter(model, hold_at=12)
        try:
            with httpx.stream("POST", f"{url}/chat/completions", json=body, headers={"Authorization": "Bearer s1"},
                              timeout=120) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                lines, first_content_at = [], None
                for line in r.iter_lines():
                    lines.append(line)
                    chunks = sse_chunks([line])
                    if first_content_at is None and chunks and content_of(chunks):
                        first_content_at = steps.count
                        steps.release.set()
        finally:
            steps.remove()
    assert steps.released_in_time, "no content chunk arrived while the generation was held"
    assert first_content_at is not None and first_content_at <= 12
    chunks = sse_chunks(lines)
    [turn] = model_turns(gw, "s1")
    assert content_of(chunks) == turn.content and len(turn.token_ids) == 40
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) > 3  # many deltas
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_a_responses_stream_sends_text_deltas_while_the_generation_runs(calc, env):
    """POST /v1/responses with stream: the output_text deltas come from the same delta source as the chat
    stream, so the first one arrives while the generation is held at its 12th step."""
    model, _ = calc
    gw = gateway(calc, env, "default", eos=[NEVER])
    body = {"model": "policy", "input": "Count to twenty.", "stream": True, "max_output_tokens": 40}
    with gw.serve() as url:
        steps = StepCounter(model, hold_at=12)
        try:
            with httpx.stream("POST", f"{url}/responses", json=body, headers={"Authorization": "Bearer r1"},
                              timeout=120) as r:
                assert r.status_code == 200
                events, first_delta_at = [], None
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(json.loads(line[len("data: "):]))
                    if first_delta_at is None and events[-1]["type"] == "response.output_text.delta":
                        first_delta_at = steps.count
                        steps.release.set()
        finally:
            steps.remove()
    assert steps.released_in_time, "no output_text delta arrived while the generation was held"
    assert first_delta_at is not None and first_delta_at <= 12
    [turn] = model_turns(gw, "r1")
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == turn.content and len(turn.token_ids) == 40
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete"  # cut by max_output_tokens


@pytest.mark.parametrize("decode", DECODES)
def test_a_streamed_call_records_exactly_what_the_same_call_records_unstreamed(calc, env, decode, tmp_path):
    gw = gateway(calc, env, decode, record_to=tmp_path / "r.jsonl")
    body = {"model": "policy", "messages": start(), "tools": env.tools, "seed": 11, "n": 2, "max_tokens": 40,
            "return_token_ids": True, "logprobs": True}
    with gw.serve() as url:
        plain = httpx.post(f"{url}/chat/completions", json=body, headers={"Authorization": "Bearer plain"},
                           timeout=120).json()
        r = httpx.post(f"{url}/chat/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}},
                       headers={"Authorization": "Bearer streamed"}, timeout=120)
        chunks = sse_chunks(r.text.splitlines())
    a, b = gw.rollouts("plain"), gw.rollouts("streamed")
    assert [[m.to_dict() for m in ro] for ro in a] == [[m.to_dict() for m in ro] for ro in b]  # byte-identical
    for i, choice in enumerate(plain["choices"]):
        assert content_of(chunks, i) == (choice["message"]["content"] or "")
        calls = [tc for c in chunks if c["choices"] and c["choices"][0]["index"] == i
                 for tc in c["choices"][0]["delta"].get("tool_calls") or []]
        assert [c["function"] for c in calls] == [c["function"] for c in choice["message"].get("tool_calls") or []]
        finish = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i
                  and c["choices"][0]["finish_reason"]]
        assert [f["finish_reason"] for f in finish] == [choice["finish_reason"]]
        assert finish[0]["token_ids"] == choice["token_ids"]
        streamed_lp = [e for c in chunks if c["choices"] and c["choices"][0]["index"] == i
                       and c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
        assert streamed_lp == choice["logprobs"]["content"]
    assert chunks[0]["prompt_token_ids"] == plain["prompt_token_ids"]
    assert chunks[-1]["usage"] == plain["usage"]
    gw.close()
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert len(lines) == 4  # two rollouts per call, written at close


def test_the_stream_is_a_reusable_iterator_of_text_deltas(calc, env):
    """`Gateway.events` (the pipeline, what the chat stream is made of) used directly: deltas, then the
    recorded result."""
    import asyncio

    from SimpleTorchLLMRL.gateway import chat
    from SimpleTorchLLMRL.gateway.request import Finished, Started
    from SimpleTorchLLMRL.gateway.streaming import Listener, TextDelta

    gw = gateway(calc, env, "default")
    req = chat.parse({"messages": start(), "stream": True, "max_tokens": 30, "seed": 2}, gw)

    async def run():
        gw.batcher.start()
        try:
            listener = Listener.of(req, gw.tokenizer, gw.tool_parsers)
            return [e async for e in gw.events(req, ("direct", False), listener)]
        finally:
            await gw.batcher.stop()

    events = asyncio.run(run())
    assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    [choice] = events[-1].result.choices
    assert len(deltas) > 1 and "".join(deltas) == choice.content == choice.message.content
    assert model_turns(gw, "direct")[0].token_ids == choice.message.token_ids


def test_a_stream_over_the_vllm_backend_comes_token_by_token(monkeypatch, tmp_path):
    """The vLLM backend steps the engine for a watched call (tests/support/fake_vllm.py here: one id per step): the engine
    is held at its 6th step until the client has read a content chunk, and the chunks carry exactly the recorded
    content. The real engine: tests/model/test_vllm_stream.py."""
    from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer
    from tests.support.engine_helpers import EngineSteps
    from tests.support.fake_vllm import install_fake_vllm

    vllm = install_fake_vllm(monkeypatch)
    tok = tiny_tokenizer("chatml")
    tiny_model("qwen2", tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = vllm.LLM(str(tmp_path), seed=0)
    gw = Gateway(ModelGenerate(llm, tok, seed=0,
                               sampling=SamplingConfig(max_new_tokens=12, temperature=1.0,
                                                       eos_token_ids=[NEVER])))
    with gw.serve() as url:
        steps = EngineSteps(llm, hold_at=6)
        try:
            with httpx.stream("POST", f"{url}/chat/completions", headers={"Authorization": "Bearer v"},
                              json={"model": "policy", "messages": start(), "stream": True}, timeout=120) as r:
                lines, first_content_at = [], None
                for line in r.iter_lines():
                    lines.append(line)
                    if first_content_at is None and content_of(sse_chunks([line])):
                        first_content_at = steps.count
                        steps.release.set()
        finally:
            steps.remove()
    [turn] = model_turns(gw, "v")
    chunks = sse_chunks(lines)
    assert steps.released_in_time and first_content_at is not None and first_content_at <= 6
    assert r.status_code == 200 and content_of(chunks) == turn.content and len(turn.token_ids) == 12
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) > 1
