"""Structured output through the gateway: response_format and tool_choice enforced by a grammar.

Driven by the real `openai` SDK, LangChain `with_structured_output`, pydantic-ai `output_type` and a
smolagents `ToolCallingAgent` against a live gateway on 127.0.0.1 over the embedded tiny model.
"""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")

import xgrammar as xgr  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from SimpleTorchLLMRL import ModelGenerate  # noqa: E402
from SimpleTorchLLMRL.chat.message import MessageType  # noqa: E402
from SimpleTorchLLMRL.chat.tokenize import encode_prompt  # noqa: E402
from SimpleTorchLLMRL.gateway import Gateway  # noqa: E402
from SimpleTorchLLMRL.gateway.request import RequestError  # noqa: E402
from SimpleTorchLLMRL.gateway.structured import build_grammar, grammar_spec  # noqa: E402
from SimpleTorchLLMRL.tools.parsers import TagToolCallParser, format_json_call  # noqa: E402
from tests.support.gateway_helpers import start  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["text"],
    "properties": {"text": {"type": "string", "maxLength": 12}}}}}

SERVED = dict(max_new_tokens=60)  # the `served` gateway's sampling (tests/gateway/conftest.py)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


def client(url: str, key: str):
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0)


def validate(value, schema) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, schema)


# ----------------------------------------------------------------------------- response_format


def test_every_json_schema_choice_parses_and_validates(served, calc):
    gw, url = served
    r = client(url, "schema").chat.completions.create(
        model="policy", messages=start("Name and age?"), n=8, seed=5, extra_body={"return_token_ids": True},
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    texts = [c.message.content for c in r.choices]
    for c in r.choices:
        assert c.finish_reason == "stop" and c.message.tool_calls is None
        validate(json.loads(c.message.content), SCHEMA)
    assert len(set(texts)) > 3  # sampled under the grammar, not one forced text
    # recorded as sampled: the returned ids, log-probs of the raw logits at T = 1 (not renormalized by the mask)
    model, tok = calc
    msgs = [m for rollout in gw.rollouts("schema") for m in rollout if m.type is MessageType.MODEL]
    assert sorted(m.token_ids for m in msgs) == sorted(c.model_extra["token_ids"] for c in r.choices)
    from tests.support.generation_helpers import reference_logprobs

    prompt = r.model_extra.get("prompt_token_ids") or encode_prompt(gw.rollouts("schema")[0][:-1], tok)
    import torch

    want = reference_logprobs(model, prompt, msgs[0].token_ids, 1.0)
    assert torch.allclose(torch.tensor(msgs[0].logprobs, dtype=torch.float64), want, atol=2e-5, rtol=0)


def test_json_object_is_one_json_object(served):
    _, url = served
    r = client(url, "object").chat.completions.create(
        model="policy", messages=start("Answer in JSON."), n=6, seed=1, max_tokens=60,
        response_format={"type": "json_object"})
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert done, [c.message.content for c in r.choices]
    for c in done:
        assert isinstance(json.loads(c.message.content), dict)
    for c in r.choices:  # cut by max_tokens: still a prefix of an object
        assert c.message.content.startswith("{")


def test_a_schema_xgrammar_cannot_compile_is_a_400_naming_response_format(served):
    _, url = served
    with pytest.raises(openai.BadRequestError) as info:
        client(url, "bad-schema").chat.completions.create(
            model="policy", messages=start(), response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}})
    assert info.value.param == "response_format" and "bogus" in info.value.message


# ----------------------------------------------------------------------------- tool_choice


def test_a_named_tool_choice_always_yields_one_parsed_call_to_it(served, env):
    _, url = served
    tools = env.tools + [NOTE]
    r = client(url, "named").chat.completions.create(
        model="policy", messages=start(), tools=tools, n=8, seed=2, temperature=1.5, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "calculator"}})
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message
        call = c.message.tool_calls[0].function
        assert call.name == "calculator"
        validate(json.loads(call.arguments), env.tools[0]["function"]["parameters"])
    r = client(url, "named-note").chat.completions.create(
        model="policy", messages=start(), tools=tools, n=4, seed=2,
        tool_choice={"type": "function", "function": {"name": "note"}})
    for c in r.choices:
        assert [t.function.name for t in c.message.tool_calls] == ["note"]
        validate(json.loads(c.message.tool_calls[0].function.arguments), NOTE["function"]["parameters"])


def test_required_always_calls_an_offered_tool(served, env):
    _, url = served
    r = client(url, "required").chat.completions.create(
        model="policy", messages=start("Write a note."), tools=env.tools + [NOTE], n=8, seed=4, temperature=1.5,
        tool_choice="required")
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
        assert {t.function.name for t in c.message.tool_calls} <= {"calculator", "note"}


def reply_grammar(*args) -> str | None:
    """The EBNF a request's fields ask for (`grammar_spec`, then `build_grammar`), None when none."""
    spec = grammar_spec(*args)
    return None if spec is None else build_grammar(spec.field, spec.key)


def test_auto_without_parallel_calls_allows_text_then_at_most_one_call():
    tools = [NOTE]
    grammar = reply_grammar(None, tools, "auto", None, False, None)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar)
    one = format_json_call("note", {"text": "hi"})

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return m.accept_string(text) and m.is_completed()

    assert accepts("Sure. " + one) and accepts("no call at all")
    assert not accepts(one + "\n" + one)
    assert not accepts('<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>')
    assert reply_grammar(None, tools, "auto", None, True, None) is None  # nothing to constrain
    required = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(
        reply_grammar(None, tools, "required", None, True, None))
    m = xgr.GrammarMatcher(required, terminate_without_stop_token=True)
    assert m.accept_string(one + "\n" + one) and m.is_completed()
    assert not xgr.GrammarMatcher(required).accept_string("text first")


def test_a_tool_format_that_cannot_be_forced_is_a_400_naming_tool_choice(calc, env):
    model, tok = calc
    gw = Gateway(ModelGenerate(model, tok,
                               max_new_tokens=8), tool_parsers=[TagToolCallParser(["calculator"])])
    with gw.serve() as url:
        for kw, field in [({"tool_choice": "required"}, "tool_choice"),
                          ({"parallel_tool_calls": False}, "parallel_tool_calls")]:
            with pytest.raises(openai.BadRequestError) as info:
                client(url, "tags").chat.completions.create(model="policy", messages=start(), tools=env.tools, **kw)
            assert info.value.param == field and "TagToolCallParser" in info.value.message
    with pytest.raises(RequestError, match="cannot both hold"):
        reply_grammar({"type": "json_object"}, env.tools, "required", None, True, None)


# ----------------------------------------------------------------------------- agent frameworks


def test_langchain_with_structured_output_returns_valid_objects(served):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    _, url = served
    llm = ChatOpenAI(model="policy", base_url=url, api_key="langchain", temperature=0, max_tokens=120,
                     max_retries=0)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Name a person and their age.")
        assert isinstance(person, Person), (method, person)
        assert len(person.name) <= 8 and 0 <= person.age <= 120


def test_pydantic_ai_output_type_returns_a_valid_object(served):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    _, url = served
    model = OpenAIChatModel("policy", provider=OpenAIProvider(base_url=url, api_key="pydantic-ai"))
    agent = Agent(model, output_type=Person, model_settings={"temperature": 0, "max_tokens": 120})
    result = agent.run_sync("Name a person and their age.")
    assert isinstance(result.output, Person) and len(result.output.name) <= 8


def test_a_smolagents_tool_calling_step_parses(served):
    smolagents = pytest.importorskip("smolagents")
    from SimpleTorchLLMRL.tools import evaluate

    _, url = served

    @smolagents.tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The arithmetic expression, for example "3 * (4 + 5)".
        """
        return str(evaluate(expression))

    model = smolagents.OpenAIServerModel(model_id="policy", api_base=url, api_key="smolagents", temperature=0,
                                         max_tokens=120)
    # one step: its tool_choice "required" call must parse (the history smolagents replays after it, tool calls
    # as "Calling tools:" text, is past what the tiny model can continue)
    agent = smolagents.ToolCallingAgent(tools=[calculator], model=model, max_steps=1, verbosity_level=0)
    agent.prompt_templates["system_prompt"] = "Solve the task with the tools."  # its own is past 1024 tokens
    agent.run("What is 645 * 49?")
    step = [s for s in agent.memory.steps if isinstance(s, smolagents.memory.ActionStep)][0]
    assert step.error is None, step.error
    assert [c.name for c in step.tool_calls] == ["calculator"] and step.observations == "31605"
