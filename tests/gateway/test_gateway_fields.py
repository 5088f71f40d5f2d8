"""Every request field is honoured or refused with an OpenAI-shaped 400 naming it; none is ignored.

Driven by the real `openai` SDK (and the Agents SDK) against a live gateway on 127.0.0.1.
"""

import asyncio
import json

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


from SimpleTorchLLMRL.chat.message import MessageType  # noqa: E402
from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402
from SimpleTorchLLMRL.gateway.request import RequestError  # noqa: E402
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig  # noqa: E402
from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT  # noqa: E402
from SimpleTorchLLMRL.tools import evaluate  # noqa: E402
from tests.support.gateway_helpers import QUESTION, parse_chat, start  # noqa: E402


def model_turns(gw: Gateway, key: str):
    return [m for r in gw.rollouts(key) for m in r if m.type is MessageType.MODEL]


# ----------------------------------------------------------------------------- tool_choice "none"


def test_tool_choice_none_offers_no_tools_and_parses_no_call(served, env):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="choice-auto")
    auto = client.chat.completions.create(model="policy", messages=start(), tools=env.tools, temperature=0,
                                          tool_choice="auto", extra_body={"return_token_ids": True})
    assert auto.choices[0].finish_reason == "tool_calls" and auto.choices[0].message.tool_calls  # it does call
    client = openai.OpenAI(base_url=url, api_key="choice-none")
    r = client.chat.completions.create(model="policy", messages=start(), tools=env.tools, temperature=0,
                                       tool_choice="none", extra_body={"return_token_ids": True})
    choice = r.choices[0]
    [m] = model_turns(gw, "choice-none")
    assert m.finish_reason == "tool_call" and "<tool_call>" in m.content  # the model still wrote a call ...
    assert not choice.message.tool_calls and choice.finish_reason == "stop"  # ... which is not a tool call
    assert choice.message.content == m.content  # the content is kept, as sampled
    assert choice.model_extra["token_ids"] == m.token_ids
    [rollout] = gw.rollouts("choice-none")
    assert "tools" not in rollout.metadata  # the template was not offered the tools
    # the prompt it was sampled from is the one without tools
    plain = client.chat.completions.create(model="policy", messages=start(), temperature=0,
                                           extra_body={"return_token_ids": True})
    assert plain.model_extra["prompt_token_ids"] == r.model_extra["prompt_token_ids"]
    if env.tools and auto.model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]:
        pytest.skip("this template renders no tools: 'not offered' cannot be seen in the prompt")


def test_tool_choice_none_streamed_has_no_tool_calls(served, env):
    _, url = served
    r = httpx.post(f"{url}/chat/completions", json={"model": "policy", "messages": start(), "tools": env.tools,
                                                    "tool_choice": "none", "temperature": 0, "stream": True},
                   headers={"Authorization": "Bearer choice-none-stream"}, timeout=120)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert not any(d["delta"].get("tool_calls") for d in deltas)
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["stop"]
    assert "<tool_call>" in "".join(d["delta"].get("content") or "" for d in deltas)


# ----------------------------------------------------------------------------- refusals

FN = {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}

# (field, value, passed as an SDK keyword): each would change the reply and is not implemented, or is an
# honoured field's value out of OpenAI's range
REFUSED = [
    ("logit_bias", {"30": -101}, True),
    ("logit_bias", {"thirty": 1}, True),
    ("logit_bias", {"99999999": 1}, True),  # outside the vocabulary
    ("logit_bias", {"30": True}, True),
    ("logit_bias", [30], True),
    ("frequency_penalty", 2.5, True),
    ("presence_penalty", -2.01, True),
    ("presence_penalty", True, True),
    ("response_format", {"type": "xml"}, True),  # json_object / json_schema are enforced (test_gateway_structured)
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, True),  # no name
    ("response_format", {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "bogus"}}}, True),
    ("parallel_tool_calls", "no", True),
    ("functions", [FN], True),
    ("function_call", "auto", True),
    ("modalities", ["text", "audio"], True),
    ("audio", {"voice": "alloy", "format": "wav"}, True),
    ("prediction", {"type": "content", "content": "31605"}, True),
    ("reasoning_effort", "low", True),
    ("verbosity", "low", True),
    ("web_search_options", {}, True),
    ("service_tier", "flex", True),
    ("tool_choice", {"type": "function", "function": {"name": "not_a_tool"}}, True),
    ("tool_choice", {"type": "function", "function": {}}, True),
    ("tool_choice", "sometimes", True),
    ("top_k", 5, False),  # not an OpenAI field: unknown fields are refused as OpenAI refuses them
    ("frobnicate", True, False),
]


@pytest.mark.parametrize(("field", "value", "keyword"), REFUSED, ids=[f"{f}={v!r}"[:40] for f, v, _ in REFUSED])
def test_a_field_that_is_not_honoured_is_a_400_naming_it(served, env, field, value, keyword):
    _, url = served
    client = openai.OpenAI(base_url=url, api_key="refused", max_retries=0)
    kw = {field: value} if keyword else {"extra_body": {field: value}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="policy", messages=start(), tools=env.tools, max_tokens=4, **kw)
    e = info.value
    assert e.status_code == 400 and e.param == field and e.type == "invalid_request_error"
    assert field in e.message or (field == "tool_choice" and "tool" in e.message)
    assert set(e.body) >= {"message", "type", "param", "code"}


def test_a_named_tool_choice_outside_the_tools_says_so(served, env):
    _, url = served
    client = openai.OpenAI(base_url=url, api_key="refused-name", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="not_a_tool.*not among"):
        client.chat.completions.create(model="policy", messages=start(), tools=env.tools,
                                       tool_choice={"type": "function", "function": {"name": "not_a_tool"}})


def test_the_refusals_record_nothing(served):
    gw, _ = served
    assert "refused" not in gw.sessions() and "refused-name" not in gw.sessions()


# ----------------------------------------------------------------------------- defaults are accepted

DEFAULTS = dict(temperature=0, top_p=1, n=1, seed=3, frequency_penalty=0, presence_penalty=0, logit_bias={},
                response_format={"type": "text"}, parallel_tool_calls=True, tool_choice="auto", modalities=["text"],
                user="user-7", safety_identifier="s-7", metadata={"episode": "7"}, store=False, service_tier="auto",
                prompt_cache_key="k", stop=None, logprobs=False, max_completion_tokens=40, audio=None,
                prediction=None, reasoning_effort=None, functions=None, function_call=None)


def test_fields_set_to_their_defaults_change_nothing(served, env):
    gw, url = served
    client = openai.OpenAI(base_url=url, api_key="plain")
    plain = client.chat.completions.create(model="policy", messages=start(), tools=env.tools, temperature=0,
                                           extra_body={"return_token_ids": True})
    client = openai.OpenAI(base_url=url, api_key="defaults")
    r = client.chat.completions.create(model="policy", messages=start(), tools=env.tools,
                                       extra_body={"return_token_ids": True}, **DEFAULTS)
    assert r.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert r.model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]
    assert r.choices[0].finish_reason == plain.choices[0].finish_reason == "tool_calls"
    [m] = model_turns(gw, "defaults")
    assert m.token_ids == r.choices[0].model_extra["token_ids"]


def test_every_field_is_classified_once():
    from SimpleTorchLLMRL.gateway.chat import HONOURED, NO_EFFECT, REFUSED_UNLESS_DEFAULT

    assert not HONOURED & NO_EFFECT and not HONOURED & set(REFUSED_UNLESS_DEFAULT)
    assert not NO_EFFECT & set(REFUSED_UNLESS_DEFAULT)
    sdk = {"messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
           "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n", "parallel_tool_calls",
           "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
           "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store",
           "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
           "verbosity", "web_search_options"}  # openai.chat.completions.create's body fields (SDK 2.x)
    assert sdk <= HONOURED | NO_EFFECT | set(REFUSED_UNLESS_DEFAULT)


def test_parse_keeps_tools_for_auto_and_drops_them_for_none(env):
    defaults = SamplingConfig(max_new_tokens=8)
    body = {"messages": start(), "tools": env.tools}
    assert parse_chat(body, defaults).tools == env.tools
    req = parse_chat({**body, "tool_choice": "none"}, defaults)
    assert req.tools is None and req.options.tool_choice == "none"
    assert parse_chat({"messages": start(), "tool_choice": "none"}, defaults).tools is None
    with pytest.raises(RequestError) as info:
        parse_chat({"messages": start(), "stream_options": "yes"}, defaults)
    assert info.value.param == "stream_options"
    with pytest.raises(RequestError) as info:
        parse_chat({"messages": start(), "stream": True, "stream_options": {"chunk_size": 4}}, defaults)
    assert info.value.param == "stream_options"
    ok = {"messages": start(), "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    assert parse_chat(ok, defaults).options.include_usage


# ----------------------------------------------------------------------------- the Agents SDK


def test_the_agents_sdk_with_explicit_default_settings_runs(served):
    agents = pytest.importorskip("agents")
    gw, url = served
    agents.set_tracing_disabled(True)

    @agents.function_tool(name_override="calculator")
    def calc_tool(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(evaluate(expression))

    settings = agents.ModelSettings(temperature=0, top_p=1, frequency_penalty=0, presence_penalty=0,
                                    parallel_tool_calls=True, tool_choice="auto", metadata={"run": "1"})

    async def run():
        client = openai.AsyncOpenAI(base_url=url, api_key="agents-fields")
        agent = agents.Agent(name="solver", instructions=SYSTEM_PROMPT, tools=[calc_tool], model_settings=settings,
                             model=agents.OpenAIChatCompletionsModel(model="policy", openai_client=client))
        try:
            await agents.Runner.run(agent, QUESTION, max_turns=2)
        except agents.exceptions.AgentsException as e:  # a tiny model may not finish; its turns are recorded
            assert not isinstance(e, agents.exceptions.UserError), e
        finally:
            await client.close()

    asyncio.run(run())
    assert model_turns(gw, "agents-fields")  # every call was answered and recorded
