"""The gateway against what a hostile or careless client sends (issue 45): forced calls complete, no request
stalls another, memory comes back, seeds hold under concurrency, every field is strictly typed, and no input
gets a 500. The embedded tiny model; servers on 127.0.0.1."""

import asyncio
import gc
import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402
from SimpleTorchLLMRL.gateway import structured as structured_module  # noqa: E402
from SimpleTorchLLMRL.gateway.request import RequestError  # noqa: E402
from SimpleTorchLLMRL.model.generation.generator import BackendConfig, ModelGenerate  # noqa: E402
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig  # noqa: E402
from SimpleTorchLLMRL.recipes.calculator.arithmetic import CALCULATOR_SCHEMA  # noqa: E402
from tests.support.gateway_helpers import parse_chat, start  # noqa: E402

NAMED = {"type": "function", "function": {"name": "calculator"}}


def gateway(calc, **kw) -> Gateway:
    model, tok = calc
    return Gateway(ModelGenerate(model, tok, max_new_tokens=40, temperature=1.0,
                                 tool_call_stop=["</tool_call>"], seed=0), **kw)


def chat(client, name="s", **body):
    return client.post("/v1/chat/completions", json={"model": "policy", "messages": start(), **body},
                       headers={"Authorization": f"Bearer {name}"})


# ----------------------------------------------------------------------------- forced calls complete


def test_a_named_tool_choice_gives_the_named_call_for_30_of_30_seeds(calc):
    gw = gateway(calc)
    with TestClient(gw.app()) as client:
        for seed in range(30):
            r = chat(client, f"named-{seed}", tools=[CALCULATOR_SCHEMA], tool_choice=NAMED, seed=seed,
                     max_tokens=200, temperature=1.5)
            assert r.status_code == 200, r.text
            [choice] = r.json()["choices"]
            calls = choice["message"].get("tool_calls") or []
            assert choice["finish_reason"] == "tool_calls" and calls, (seed, choice)
            assert {c["function"]["name"] for c in calls} == {"calculator"}
            assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)


def test_no_stop_string_cuts_a_constrained_reply(calc):
    """A grammar whose only reply holds the tool-call stop and a request stop string: sampled whole."""
    model, tok = calc
    gen = ModelGenerate(model, tok, sampling=SamplingConfig(max_new_tokens=30, tool_call_stop=["</tool_call>"],
                                                            stop=["b"]))
    grammar = 'root ::= "a</tool_call>b{\\"x\\": \\"</tool_call>\\"}"'
    cfg = SamplingConfig(max_new_tokens=30, tool_call_stop=["</tool_call>"], stop=["b"], grammar=grammar)
    assert cfg.all_stops == () and SamplingConfig(stop=["b"]).all_stops == ("b",)
    [[msg]] = gen.generate([[5, 6, 7]], sampling=cfg)
    assert msg.content == 'a</tool_call>b{"x": "</tool_call>"}' and msg.finish_reason == "stop"


def test_a_max_tokens_cut_inside_a_forced_call_is_length_with_no_fragment(calc):
    gw = gateway(calc)
    with TestClient(gw.app()) as client:
        r = chat(client, tools=[CALCULATOR_SCHEMA], tool_choice="required", max_tokens=5, seed=1)
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None and not choice["message"].get("tool_calls")
    [rollout] = gw.rollouts("s")
    assert rollout[-1].finish_reason == "length" and "<tool_call>" in rollout[-1].content  # recorded as sampled


# ----------------------------------------------------------------------------- no request stalls another


PATHOLOGICAL = {
    "20,000 tools, required": dict(tools=[{"type": "function", "function": {"name": f"t{i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}} for i in range(20_000)], tool_choice="required"),
    "a 10k-value enum": dict(response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "enum": [f"value number {i}" for i in range(10_000)]}}}),
    "a 30k-value enum": dict(response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "enum": list(range(30_000))}}}),
    "pattern a{1,16000}": dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "string", "pattern": "a{1,16000}"}}}),
    "a 12,000-string enum": dict(response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "type": "object", "properties": {"k": {"enum": [f"key {i} " * 3 for i in range(12_000)]}}}}}),
}


def neighbours_answer_while(url: str, send) -> list[float]:
    """Seconds each /health and each neighbour's short chat request took while `send()` runs in a thread."""
    took, done = [], threading.Event()
    thread = threading.Thread(target=lambda: (send(), done.set()))
    neighbour = {"model": "policy", "messages": start(), "max_tokens": 1}
    with httpx.Client(timeout=30) as client:
        client.get(url.removesuffix("/v1") + "/health")  # connected, and the neighbour's path warm
        assert client.post(f"{url}/chat/completions", json=neighbour).status_code == 200
        thread.start()
        while not took or not done.is_set():  # at least once, then until the request is answered
            t0 = time.perf_counter()
            assert client.get(url.removesuffix("/v1") + "/health").status_code == 200
            took.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = client.post(f"{url}/chat/completions", json=neighbour, headers={"Authorization": "Bearer neighbour"})
            assert r.status_code == 200
            took.append(time.perf_counter() - t0)
        thread.join()
    return took


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_a_pathological_request_is_refused_before_any_compile_and_stalls_no_one(calc, name, monkeypatch):
    built = []
    monkeypatch.setattr(structured_module, "build_grammar", lambda *a: built.append(a) or pytest.fail("compiled"))
    gw = gateway(calc, window=0.0)
    out = {}
    # serialized before the clock starts: the client runs in this process, and its json.dumps would hold the GIL
    body = json.dumps({"model": "policy", "messages": start(), **PATHOLOGICAL[name]}).encode()
    with gw.serve() as url:
        def send():
            out["r"] = httpx.post(f"{url}/chat/completions", timeout=60, content=body,
                                  headers={"Authorization": "Bearer bad", "content-type": "application/json"})

        took = neighbours_answer_while(url, send)
    assert out["r"].status_code == 400 and out["r"].json()["error"]["param"] in ("tools", "response_format")
    assert built == [] and max(took) < 0.5, took


def test_a_slow_compile_runs_off_the_loop_and_past_its_budget_is_a_400(calc, monkeypatch):
    """A grammar that takes 3 s to build (standing in for anything that passes the limits and is still slow):
    /health and a neighbour answer within 0.5 s meanwhile, and the request is a 400 naming the field once its
    1 s budget is spent."""
    real = structured_module.build_grammar

    def slow(field, key):
        if "slow_field" in key:
            time.sleep(3)
        return real(field, key)

    monkeypatch.setattr(structured_module, "build_grammar", slow)
    gw = gateway(calc, window=0.0, compile_budget=1.0)
    schema = {"type": "object", "properties": {"slow_field": {"type": "integer"}}}
    out = {}
    with gw.serve() as url:
        def send():
            out["r"] = httpx.post(f"{url}/chat/completions", timeout=60, json={
                "model": "policy", "messages": start(),
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})

        took = neighbours_answer_while(url, send)
    assert out["r"].status_code == 400, out["r"].text
    error = out["r"].json()["error"]
    assert error["param"] == "response_format" and error["code"] == "grammar_too_complex"
    assert max(took) < 0.5, took


def test_grammars_compile_on_their_own_threads_not_the_generation_worker(calc, monkeypatch):
    import xgrammar as xgr

    threads = []
    real = xgr.GrammarCompiler.compile_grammar

    def spy(self, grammar):
        threads.append(threading.current_thread().name)
        return real(self, grammar)

    monkeypatch.setattr(xgr.GrammarCompiler, "compile_grammar", spy)
    gw = gateway(calc)
    schema = {"type": "object", "properties": {"answer_on_a_thread": {"type": "integer"}}, "required": [
        "answer_on_a_thread"]}
    with TestClient(gw.app()) as client:
        r = chat(client, max_tokens=30, response_format={"type": "json_schema", "json_schema": {
            "name": "a", "schema": schema}})
    assert r.status_code == 200 and isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    assert threads and all(t.startswith("grammar") for t in threads), threads


# ----------------------------------------------------------------------------- bounded memory


@pytest.mark.slow
def test_memory_comes_back_after_2000_schemas_tool_sets_and_expired_sessions(calc):
    psutil = pytest.importorskip("psutil")
    clock = [0.0]
    gw = gateway(calc, session_ttl=10, clock=lambda: clock[0], window=0.0)
    process = psutil.Process()

    def schema(i):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "properties": {f"field_{i}": {"type": "integer"}}, "required": [f"field_{i}"]}}}}

    def tools(i):
        return {"tools": [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
            "type": "object", "properties": {f"arg_{i}": {"type": "string"}}}}}]}

    def round_of(client, start_at: int, count: int) -> None:
        for i in range(start_at, start_at + count):
            for kind, extra in (("schema", schema(i)), ("tools", tools(i)), ("session", {})):
                r = client.post("/v1/chat/completions", json={"model": "policy", "messages": start(f"{i}?"),
                                                             "max_tokens": 1, **extra},
                                headers={"X-Session-Id": f"{kind}-{i}"})
                assert r.status_code == 200, r.text
            clock[0] += 11  # every session of this round expires at the next call

    with TestClient(gw.app()) as client:
        round_of(client, 0, 100)  # warm: imports, first allocations, the caches filled to their bounds
        gc.collect()
        before = process.memory_info().rss
        round_of(client, 100, 2000)
        gc.collect()
        after = process.memory_info().rss
        assert len(gw.store) <= 3 and len(gw.locks) == 0
    assert (after - before) / 2**20 < 50, f"RSS grew {(after - before) / 2**20:.0f} MB"


def test_every_cache_is_bounded():
    from SimpleTorchLLMRL.chat import template
    from SimpleTorchLLMRL.gateway import batcher
    from SimpleTorchLLMRL.model.generation import constrain

    assert structured_module.build_grammar.cache_info().maxsize == structured_module.BUILT
    assert constrain.check_grammar.cache_info().maxsize <= 64
    assert constrain.MAX_COMPILED and constrain.MAX_COMPILED_BYTES
    assert template.MAX_TEMPLATES and batcher.MAX_RECORDS


def test_session_locks_go_with_their_calls(calc):
    gw = gateway(calc)
    with TestClient(gw.app()) as client:
        for i in range(20):
            assert client.post("/v1/chat/completions", json={"model": "policy", "messages": start(), "max_tokens": 1},
                               headers={"X-Session-Id": f"lock-{i}"}).status_code == 200
    assert len(gw.locks) == 0


# ----------------------------------------------------------------------------- seeds under concurrency


@pytest.mark.parametrize("decode", ["default", "fast"])
def test_a_seeded_request_is_the_same_alone_or_batched_with_others(calc, decode):
    model, tok = calc
    gw = Gateway(ModelGenerate(model, tok, max_new_tokens=24, temperature=1.0,
                               backend=BackendConfig(decode=decode)), window=0.5)
    body = {"model": "policy", "messages": start(), "seed": 42, "return_token_ids": True}

    async def send(client, k, extra):
        r = await client.post("/chat/completions", json={**body, **extra}, headers={"Authorization": f"Bearer c{k}"})
        return r.json()["choices"][0]["token_ids"]

    async def run(url, bodies):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*[send(client, k, extra) for k, extra in enumerate(bodies)])

    with gw.serve() as url:
        [alone] = asyncio.run(run(url, [{}]))
        together = asyncio.run(run(url, [{}, {}, {"seed": 7}, {}, {"messages": start("What is 2 + 2?")}, {}]))
    assert list(gw.batcher.batches)[-1] == 6  # all six in one batch
    assert [together[k] for k in (0, 1, 3, 5)] == [alone] * 4
    assert together[2] != alone


# ----------------------------------------------------------------------------- strict input, never a 500


@pytest.mark.parametrize("field, value", [
    ("stream", "false"), ("return_token_ids", "no"), ("logprobs", "yes"), ("parallel_tool_calls", "false"),
    ("stream", 0), ("n", 1.0), ("max_tokens", "5"), ("seed", 1.5), ("top_logprobs", True), ("top_p", 0),
    ("top_p", 1.5), ("temperature", "hot"),
])
def test_fields_are_strictly_typed(field, value):
    with pytest.raises(RequestError) as info:
        parse_chat({"messages": start(), "tools": [CALCULATOR_SCHEMA], field: value})
    assert info.value.status == 400 and info.value.param == field


def test_top_p_is_in_the_open_low_interval():
    assert parse_chat({"messages": start(), "top_p": 1}).sampling.top_p == 1
    assert parse_chat({"messages": start(), "top_p": 0.01}).sampling.top_p == 0.01


def rf(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("schema, words", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if'"),
    ({"type": "integer", "not": {"const": 3}}, "'not'"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "string", "format": "color"}, "format"),
    ({"$ref": "#"}, "no finite instance"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "no finite instance"),
    ({"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}, "no finite instance"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, "does not resolve"),
    ({"$ref": "http://example.com/s.json"}, "local"),
    ({"type": "string", "pattern": "[a-z]{1,5000}"}, "repeats"),
    ({"enum": list(range(1001))}, "enum"),
    ({"type": "string", "maxLength": 100_000}, "maxLength"),
])
def test_a_schema_the_grammar_cannot_enforce_or_finish_is_a_400_naming_it(schema, words):
    with pytest.raises(RequestError, match=words) as info:
        parse_chat({"messages": start(), **rf(schema)})
    assert info.value.status == 400 and info.value.param == "response_format"


def test_schemas_that_can_finish_pass():
    tree = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {
        "$ref": "#/$defs/node"}}}, "required": ["kids"]}}, "$ref": "#/$defs/node"}  # base case: no kids
    tagged = {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                        {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]}
    for schema in (tree, tagged, {"type": ["string", "null"], "title": "t", "description": "d"}):
        assert parse_chat({"messages": start(), **rf(schema)}).grammar is not None


def test_the_tools_a_request_may_offer_are_bounded():
    tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(129)]
    with pytest.raises(RequestError, match="at most 128") as info:
        parse_chat({"messages": start(), "tools": tools})
    assert info.value.param == "tools"


LONE = "\ud800"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {LONE}"}]}),
    ("/v1/chat/completions", {"messages": start(), "tools": [{"type": "function", "function": {"name": LONE}}]}),
    ("/v1/chat/completions", {"model": LONE, "messages": start()}),
    ("/v1/responses", {"input": f"hi {LONE}"}),
    ("/v1/completions", {"prompt": LONE}),
])
def test_text_that_is_not_valid_unicode_is_a_400(calc, path, body):
    gw = gateway(calc)
    raw = json.dumps({"model": "policy", **body})  # json.dumps writes the lone surrogate as \ud800: valid JSON
    assert "\\ud800" in raw
    with TestClient(gw.app()) as client:
        r = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"])
def test_only_documented_routes_answer(calc, path):
    with TestClient(gateway(calc).app()) as client:
        r = client.get(path)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"


def test_random_bodies_get_a_400_or_an_answer_never_a_500():
    """parse (the chat route's, where every client field is read) on generated JSON: it returns a request or
    raises RequestError, nothing else."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                     st.text(max_size=8))
    value = st.recursive(leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["type", "enum", "properties", "required", "$ref", "items", "pattern", "anyOf", "name",
                         "schema", "function", "parameters", "x"]), kids, max_size=4), max_leaves=12)
    fields = st.sampled_from(["tools", "tool_choice", "response_format", "n", "seed", "stop", "logit_bias", "top_p",
                              "max_tokens", "stream", "logprobs", "top_logprobs", "parallel_tool_calls",
                              "stream_options", "chat_template_kwargs", "messages"])

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(st.dictionaries(fields, value, max_size=4))
    def check(extra):
        body = {"messages": start(), **extra}
        try:
            req = parse_chat(body, vocab_size=100)
            if req.grammar is not None:  # what the pipeline builds off the loop: a 400 at worst too
                structured_module.build_grammar(req.grammar.field, req.grammar.key)
        except RequestError as e:
            assert e.status in (400, 404)

    check()
