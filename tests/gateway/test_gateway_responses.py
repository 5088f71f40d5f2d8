"""POST /v1/responses: the real `openai` SDK and the real OpenAI Agents SDK (only `base_url` set) against a
live gateway on 127.0.0.1, recording exactly what was sampled."""

import asyncio
import dataclasses
import inspect
import json

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from SimpleTorchLLMRL import ModelGenerate  # noqa: E402
from SimpleTorchLLMRL.chat.message import MessageType, Rollout  # noqa: E402
from SimpleTorchLLMRL.chat.tokenize import encode_prompt, encode_rollout  # noqa: E402
from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402
from SimpleTorchLLMRL.gateway.responses import (  # noqa: E402
    HONOURED,
    PASSED,
    REFUSED_UNLESS_DEFAULT,
    stream_events,
)
from SimpleTorchLLMRL.gateway.sessions import MAX_LINKS, SessionStore  # noqa: E402
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig  # noqa: E402
from SimpleTorchLLMRL.recipes.calculator.arithmetic import CALCULATOR_SCHEMA, SYSTEM_PROMPT  # noqa: E402
from SimpleTorchLLMRL.tools import evaluate  # noqa: E402
from tests.support.gateway_helpers import QUESTION, calc_env  # noqa: E402

TOOLS = [{"type": "function", **CALCULATOR_SCHEMA["function"]}]  # the calculator in the Responses shape
TOKEN_IDS = {"return_token_ids": True}

SERVED = dict(temperature=0.0)  # greedy: every test's episode is the same (tests/gateway/conftest.py)


def make_gateway(calc, **kw) -> Gateway:
    model, tok = calc
    generator = ModelGenerate(model, tok, max_new_tokens=40, temperature=0.0,
                              tool_call_stop=calc_env().stop_strings, seed=0)
    return Gateway(generator, **kw)


def sampled(rollout):
    return [m for m in rollout if m.token_ids is not None]


def run_calls(response) -> list[dict]:
    """The function_call_output items answering a response's calls, computed by the calculator."""
    return [{"type": "function_call_output", "call_id": o.call_id,
             "output": str(evaluate(json.loads(o.arguments)["expression"]))}
            for o in response.output if o.type == "function_call"]


def check_exact(rollout, responses, tok):
    """Each response's ids are the MODEL message's, placed as sampled where the trainer encodes them."""
    turns = sampled(rollout)
    assert len(turns) == len(responses)
    enc = encode_rollout(rollout, tok)
    for r, m in zip(responses, turns, strict=True):
        ids, prompt = r.model_extra["token_ids"], r.model_extra["prompt_token_ids"]
        assert m.token_ids == ids and m.is_trainable
        assert r.usage.output_tokens == len(ids) and r.usage.input_tokens == len(prompt)
        assert enc.input_ids[: len(prompt) + len(ids)] == prompt + ids
    trained = [t for t, k in zip(enc.input_ids, enc.loss_mask, strict=True) if k]
    assert trained == [t for m in turns for t in m.token_ids]  # exactly the sampled ids are trained


# ----------------------------------------------------------------------------- the openai SDK


def test_a_plain_response_is_the_recorded_turn(served, calc):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="plain-1")
    r = client.responses.create(model="policy", instructions=SYSTEM_PROMPT, input=QUESTION, extra_body=TOKEN_IDS)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "policy"
    assert r.status in ("completed", "incomplete") and r.instructions == SYSTEM_PROMPT
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    [rollout] = gw.rollouts("plain-1")
    assert [m.type for m in rollout] == [MessageType.SYSTEM, MessageType.MESSAGE, MessageType.MODEL]
    assert r.output_text == rollout[-1].content  # no tools offered: the text as sampled
    check_exact(rollout, [r], calc[1])
    # the same conversation through Chat Completions is conditioned on the same ids
    chat = client.chat.completions.create(model="policy", messages=[{"role": "system", "content": SYSTEM_PROMPT},
                                                                    {"role": "user", "content": QUESTION}],
                                          extra_body=TOKEN_IDS)
    assert chat.model_extra["prompt_token_ids"] == r.model_extra["prompt_token_ids"]
    assert chat.choices[0].model_extra["token_ids"] == r.model_extra["token_ids"]  # greedy: the same reply


def test_a_tool_episode_through_the_openai_sdk_is_one_rollout_of_the_returned_ids(served, calc):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="tools-1")
    items, responses = [{"role": "user", "content": QUESTION}], []
    for _ in range(3):  # an agent loop written against the Responses API
        r = client.responses.create(model="policy", instructions=SYSTEM_PROMPT, input=items, tools=TOOLS,
                                    extra_body=TOKEN_IDS)
        responses.append(r)
        items += [o.model_dump(exclude_none=True) for o in r.output] + run_calls(r)
        if not run_calls(r):
            break
    calls = [o for o in responses[0].output if o.type == "function_call"]
    assert calls and calls[0].name == "calculator" and calls[0].id.startswith("fc_")  # a real tool turn
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed"
    [rollout] = gw.rollouts("tools-1")
    assert len(responses) >= 2
    check_exact(rollout, responses, calc[1])
    assert [m for m in rollout if m.type is MessageType.TOOL][0].content == "31605"
    assert rollout.metadata["tools"] == [{"type": "function", "function": CALCULATOR_SCHEMA["function"]}]


class _TextThenCall:
    """The real generator, except that its first reply is text followed by a tool call, as encoded (the
    embedded model, greedy, only writes bare calls); the recorded ids are that text's."""

    TEXT = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "645 * 49"}}\n</tool_call>'

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, rollouts, n=1, **kw):
        out = self.inner.generate(rollouts, n, **kw)
        self.calls += 1
        if self.calls == 1:
            ids = self.inner.tokenizer.encode(self.TEXT, add_special_tokens=False)
            out = [[dataclasses.replace(m, content=self.TEXT, token_ids=ids, logprobs=[0.0] * len(ids),
                                        finish_reason="tool_call") for m in row] for row in out]
        return out


def test_a_turn_of_text_and_a_call_replayed_as_two_items_merges(calc):
    gw = make_gateway(calc)
    gw.generator = gw.batcher.generator = _TextThenCall(gw.generator)
    with gw.serve() as url:
        client = openai.OpenAI(base_url=url, api_key="text-call")
        first = client.responses.create(model="policy", input=QUESTION, tools=TOOLS, extra_body=TOKEN_IDS)
        assert [o.type for o in first.output] == ["message", "function_call"]
        assert first.output[0].content[0].text == "Let me compute."
        items = [{"role": "user", "content": QUESTION}, *[o.model_dump(exclude_none=True) for o in first.output],
                 *run_calls(first)]
        second = client.responses.create(model="policy", input=items, tools=TOOLS, extra_body=TOKEN_IDS)
    [rollout] = gw.rollouts("text-call")  # the two items are the one turn sampled
    check_exact(rollout, [first, second], calc[1])
    assert sampled(rollout)[0].content == _TextThenCall.TEXT


def test_streaming_sends_the_responses_events_in_order(served, calc):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="stream-1")
    with client.responses.stream(model="policy", instructions=SYSTEM_PROMPT, input=QUESTION, tools=TOOLS,
                                 extra_body=TOKEN_IDS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.function_call_arguments.delta",
                                        "response.function_call_arguments.done", "response.output_item.done",
                                        "response.completed"]
    [call] = final.output
    assert call.type == "function_call" and events[3].delta == call.arguments == events[4].arguments
    assert events[0].response.status == "in_progress" and events[-1].response.id == final.id
    [rollout] = gw.rollouts("stream-1")
    check_exact(rollout, [final], calc[1])
    # the follow-up, streamed with stream=True on create: a text reply's events
    items = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), *run_calls(final)]
    events = list(client.responses.create(model="policy", instructions=SYSTEM_PROMPT, input=items, tools=TOOLS,
                                          stream=True, extra_body=TOKEN_IDS))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == [  # one or more deltas, as sampled
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    done = events[-1].response
    text_done = next(e for e in events if e.type == "response.output_text.done")
    assert "".join(deltas) == text_done.text == done.output_text
    [rollout] = gw.rollouts("stream-1")  # merged: one rollout of both turns
    check_exact(rollout, [final, done], calc[1])


def test_the_event_generator_takes_text_deltas_as_they_come():
    """Incremental deltas plug in unchanged: the openai SDK's own stream state accepts the events."""
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    message = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "The answer is 7.", "annotations": []}]}
    call = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "calculator",
            "arguments": "{\"expression\": \"3 + 4\"}", "status": "completed"}
    start = {"id": "resp_1", "object": "response", "created_at": 0, "status": "in_progress", "model": "policy",
             "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    final = {**start, "status": "completed", "output": [message, call]}

    async def deltas():
        for piece in ["The ", "answer ", "is 7."]:
            yield piece

    async def finish():
        return final

    async def collect(source):
        return [e async for e in stream_events(start, "msg_1", source, finish)]

    events = asyncio.run(collect(deltas()))
    assert [e["type"] for e in events].count("response.output_text.delta") == 3
    state, adapter = ResponseStreamState(input_tools=[], text_format=openai.omit), TypeAdapter(ResponseStreamEvent)
    for e in events:
        state.handle_event(adapter.validate_python(e))
    done = state._completed_response
    assert done.output_text == "The answer is 7." and done.output[1].arguments == call["arguments"]
    async def one_delta(text):  # the whole text as one delta gives the same events but for the deltas
        yield text

    whole = asyncio.run(collect(one_delta("The answer is 7.")))
    assert [e["type"] for e in whole if e["type"] != "response.output_text.delta"] == \
        [e["type"] for e in events if e["type"] != "response.output_text.delta"]


# ----------------------------------------------------------------------------- previous_response_id


def test_previous_response_id_continues_the_conversation_in_its_session(served, calc):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="prev-1")
    first = client.responses.create(model="policy", instructions=SYSTEM_PROMPT, input=QUESTION, tools=TOOLS,
                                    extra_body=TOKEN_IDS)
    assert run_calls(first)
    # only the new items, under another key: the link names the session
    other = openai.OpenAI(base_url=url, api_key="someone-else")
    second = other.responses.create(model="policy", instructions=SYSTEM_PROMPT, previous_response_id=first.id,
                                    input=run_calls(first), tools=TOOLS, extra_body=TOKEN_IDS)
    assert second.previous_response_id == first.id
    [rollout] = gw.rollouts("prev-1")
    check_exact(rollout, [first, second], calc[1])
    assert "someone-else" not in gw.sessions()
    # the follow-up was conditioned on the first call's prompt and its sampled ids, as they were
    before = first.model_extra["prompt_token_ids"] + first.model_extra["token_ids"]
    assert second.model_extra["prompt_token_ids"][: len(before)] == before
    # a stored response can be read back while its session lives
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output[0].call_id == first.output[0].call_id


def test_previous_response_id_errors_name_it(served):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="prev-err")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="policy", input="hi", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id" and e.value.code == "previous_response_not_found"
    unstored = client.responses.create(model="policy", input="hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="policy", input="more", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(unstored.id)
    assert e.value.body["param"] == "response_id"
    assert len(gw.rollouts("prev-err")) == 1  # the refused calls recorded nothing


def test_links_go_with_their_session(calc):
    now = [0.0]
    gw = make_gateway(calc, session_ttl=10.0, clock=lambda: now[0])
    with gw.serve() as url:
        client = openai.OpenAI(base_url=url, api_key="ttl-1")
        r = client.responses.create(model="policy", input=QUESTION, max_output_tokens=2)
        assert gw.store.linked(r.id) is not None
        now[0] = 11.0  # idle past the TTL: the session, and its link, are finished
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="policy", input="more", previous_response_id=r.id, max_output_tokens=2)
        assert e.value.body["param"] == "previous_response_id"
        assert gw.store._links == {}
        r = client.responses.create(model="policy", input=QUESTION, max_output_tokens=2)
        gw.clear("ttl-1")
        assert gw.store.linked(r.id) is None and gw.store._links == {}


def test_a_session_keeps_its_latest_links_only():
    store = SessionStore()
    from SimpleTorchLLMRL.gateway.request import GenRequest

    req = GenRequest(SamplingConfig(), messages=[{"role": "user", "content": "hi"}])
    session, plan = store.open("k", req)
    store.record(session, plan, [], [])
    store.release(session)
    for i in range(MAX_LINKS + 10):
        assert store.link(f"resp_{i}", session, i)
    assert len(store._links) == len(session.links) == MAX_LINKS
    assert store.linked("resp_9") is None and store.linked(f"resp_{MAX_LINKS + 9}")[1] == MAX_LINKS + 9
    store.take(["k"])
    assert store._links == {} and not store.link("resp_x", session, 0)  # a finished session links nothing


# ----------------------------------------------------------------------------- fields


def test_settings_are_honoured_and_echoed(served, calc):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="settings-1")
    r = client.responses.create(model="policy", input=QUESTION, max_output_tokens=3, temperature=1.0, top_p=0.9,
                                include=["message.output_text.logprobs"], top_logprobs=2, metadata={"run": "1"},
                                user="u", store=True, truncation="disabled", reasoning=None,
                                text={"format": {"type": "text"}}, extra_body=TOKEN_IDS)
    [m] = sampled(gw.rollouts("settings-1")[0])
    assert len(m.token_ids) == 3 and m.temperature == 1.0  # this call's sampling, recorded
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.temperature == 1.0 and r.top_p == 0.9 and r.max_output_tokens == 3 and r.metadata == {"run": "1"}
    [part] = r.output[0].content
    assert [lp.logprob for lp in part.logprobs] == pytest.approx(m.logprobs)
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)


BAD = [  # (body, status, param)
    ({"model": "policy"}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "function_call", "name": "calculator", "arguments": "{}"}]}, 400, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "calculator", "arguments": "2+2"}]}, 400,
     "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "4"}]}, 400, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]}, 400,
     "input[0].output[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0].type"),
    ({"input": [{"role": "tool", "content": "4"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": "hi", "cache": True}]}, 400, "input[0].cache"),
    ({"input": "hi", "instructions": 5}, 400, "instructions"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, 400, "tools"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "bogus"}}}}, 400,
     "text.format"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "text.format"),
    ({"input": "hi", "reasoning": {"effort": "low"}}, 400, "reasoning"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ({"input": "hi", "include": ["file_search_call.results"]}, 400, "include"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "temperature": 5}, 400, "temperature"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "conversation": "conv_1"}, 400, "conversation"),
    ({"input": "hi", "service_tier": "flex"}, 400, "service_tier"),
    ({"input": "hi", "stream_options": {"chunk": 1}}, 400, "stream_options"),
    ({"input": "hi", "top_k": 5}, 400, "top_k"),
    ({"input": "hi", "model": "gpt-4.1"}, 404, "model"),
]


def test_text_format_json_schema_is_enforced(served):
    """text.format maps onto the chat path's response_format: the reply is JSON of the schema."""
    gw, url = served
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    body = {"input": "What is 2 + 2?", "temperature": 1.0,
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}}
    r = httpx.post(f"{url}/responses", json=body, headers={"Authorization": "Bearer json-1"}, timeout=60)
    assert r.status_code == 200, r.text
    [item] = r.json()["output"]
    value = json.loads(item["content"][0]["text"])
    assert set(value) == {"answer"} and isinstance(value["answer"], int)


@pytest.mark.parametrize("body,status,param", BAD, ids=[p for _, _, p in BAD])
def test_bad_requests_get_openai_errors_naming_the_field(served, body, status, param):
    gw, url = served
    r = httpx.post(f"{url}/responses", json=body, headers={"Authorization": "Bearer bad-1"}, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert "bad-1" not in gw.sessions()  # a refused request is not recorded


def test_the_chat_paths_errors_name_the_responses_fields(served):
    gw, url = served
    ctx = gw.generator.max_context
    too_long = {"input": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x" * (ctx * 32 + 1)}]}
    r = httpx.post(f"{url}/responses", json=too_long, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "input"  # the chat path says "messages"
    r = httpx.post(f"{url}/responses", json={"input": "hi", "max_output_tokens": ctx}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"  # prompt + max_output_tokens > ctx


def test_every_field_of_the_sdk_is_honoured_passed_or_refused():
    sdk = set(inspect.signature(openai.resources.responses.Responses.create).parameters)
    sdk -= {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
    assert sdk <= HONOURED | PASSED | set(REFUSED_UNLESS_DEFAULT), sdk - (HONOURED | PASSED | set(REFUSED_UNLESS_DEFAULT))


def test_a_wrong_method_and_an_unknown_response_are_openai_errors(served):
    _, url = served
    r = httpx.get(f"{url}/responses", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.get(f"{url}/responses/resp_nope", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


# ----------------------------------------------------------------------------- the Agents SDK, unmodified


@pytest.fixture
def agents_sdk():
    """The `agents` module with tracing off (nothing leaves the machine); its default client restored after."""
    agents = pytest.importorskip("agents")
    from agents.models import _openai_shared

    before = _openai_shared.get_default_openai_client()
    agents.set_tracing_disabled(True)
    yield agents
    if before is not None:
        agents.set_default_openai_client(before)
    else:
        _openai_shared._default_openai_client = None


def calculator_agent(agents):
    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / // % ** and parentheses."""
        return str(evaluate(expression))

    return agents.Agent(name="solver", instructions=SYSTEM_PROMPT, tools=[calculator], model="policy")


def check_agent_episode(rollout, raw_responses, tok):
    """Each model response of the run is one MODEL message of the episode's rollout, with the exact
    sampled ids (their count is the response's usage; the prompt before them is its input)."""
    turns = sampled(rollout)
    assert len(turns) == len(raw_responses) >= 2
    enc = encode_rollout(rollout, tok)
    at = [i for i, m in enumerate(rollout) if m.token_ids is not None]
    for raw, m, i in zip(raw_responses, turns, at, strict=True):
        prompt = encode_prompt(Rollout(rollout.messages[:i], rollout.metadata), tok)
        assert raw.usage.output_tokens == len(m.token_ids) and raw.usage.input_tokens == len(prompt)
        assert enc.input_ids[: len(prompt) + len(m.token_ids)] == prompt + m.token_ids
        assert m.is_trainable
    trained = [t for t, k in zip(enc.input_ids, enc.loss_mask, strict=True) if k]
    assert trained == [t for m in turns for t in m.token_ids]


def test_the_agents_sdk_with_only_base_url_set_runs_a_tool_episode(served, calc, agents_sdk):
    gw, url = served
    agents = agents_sdk

    async def run():
        agents.set_default_openai_client(openai.AsyncOpenAI(base_url=url, api_key="agents-1"))
        result = await agents.Runner.run(calculator_agent(agents), QUESTION, max_turns=3)
        streamed = agents.Runner.run_streamed(calculator_agent(agents), "What is 312 * 17?", max_turns=3)
        async for _ in streamed.stream_events():
            pass
        return result, streamed

    result, streamed = asyncio.run(run())
    assert result.final_output == "\\boxed{31605}"  # the embedded model called the tool, then answered
    rollouts = gw.rollouts("agents-1")
    assert len(rollouts) == 2  # two episodes under one key: one rollout each (matched by prefix)
    by_question = {r[1].content: r for r in rollouts}
    for question, run in ((QUESTION, result), ("What is 312 * 17?", streamed)):
        rollout = by_question[question]
        check_agent_episode(rollout, run.raw_responses, calc[1])
        assert any(m.type is MessageType.TOOL for m in rollout)
        for raw in run.raw_responses:  # each response the SDK saw is linked to the episode
            assert gw.store.linked(raw.response_id)[0].name == "agents-1"


def test_the_agents_sdk_chaining_by_previous_response_id_merges(served, calc, agents_sdk):
    gw, url = served
    agents = agents_sdk

    async def run():
        agents.set_default_openai_client(openai.AsyncOpenAI(base_url=url, api_key="agents-chain"))
        return await agents.Runner.run(calculator_agent(agents), QUESTION, max_turns=3,
                                       auto_previous_response_id=True)

    result = asyncio.run(run())
    assert result.final_output == "\\boxed{31605}"
    first, second = (gw.store.linked(raw.response_id)[1].response for raw in result.raw_responses[:2])
    assert second["previous_response_id"] == first["id"]  # the SDK chained the calls
    [rollout] = gw.rollouts("agents-chain")  # the follow-ups sent only their new items, and merged
    check_agent_episode(rollout, result.raw_responses, calc[1])


def test_the_agents_sdk_responses_example_records_its_episodes(calc):
    pytest.importorskip("agents")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "gateway_agents_sdk_responses.py"
    spec = importlib.util.spec_from_file_location("gateway_agents_sdk_responses", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rollouts = example.main()
    assert len(rollouts) == 3 and {r[1].content for r in rollouts} == set(example.QUESTIONS)
    for r in rollouts:
        enc = encode_rollout(r, calc[1])
        trained = [t for t, k in zip(enc.input_ids, enc.loss_mask, strict=True) if k]
        assert trained and trained == [t for m in sampled(r) for t in m.token_ids]


def test_a_stream_whose_generation_fails_ends_with_an_error_event(calc, monkeypatch):
    """After the headers went out, a failed generation is an `error` event (OpenAI's streamed error), not a
    dropped connection; nothing is recorded."""
    gw = make_gateway(calc)

    def broken(*args, **kwargs):
        raise ValueError("the engine refused this call")

    monkeypatch.setattr(gw.generator, "generate", broken)
    with gw.serve(host="127.0.0.1", port=0) as url:
        r = httpx.post(f"{url}/responses", json={"model": "policy", "input": "hi", "stream": True},
                       headers={"Authorization": "Bearer broken-1"}, timeout=60)
    assert r.status_code == 200
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "error" and "the engine refused this call" in events[-1]["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "broken-1" not in gw.sessions()
