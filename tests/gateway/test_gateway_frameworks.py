"""The gateway driven by the agent frameworks people use, unmodified, on a live server on 127.0.0.1.

LangGraph `create_react_agent`, langchain 1.x `create_agent` (both over `ChatOpenAI`), pydantic-ai,
litellm, smolagents' `OpenAIServerModel` and the OpenAI Agents SDK (its Chat Completions model) run
tool episodes on the embedded calculator model. Each episode must be exactly one rollout whose
MODEL messages carry the ids the gateway sampled and answered with; the trainer's encoding of the
rollout reproduces each call's prompt ids followed by its sampled ids, and trains exactly those.

The frameworks send what they send by default; the only addition is the gateway's own
`return_token_ids` through each framework's `extra_body`, so the answers carry the ids to compare.
The HTTP exchanges are read off the transports of httpx and httpx2 (every framework here uses one),
and no test may open a connection or resolve a name off this machine (`no_network`).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections import Counter
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: the bundled cost map, never a fetch

from SimpleTorchLLMRL.chat.message import MessageType  # noqa: E402
from SimpleTorchLLMRL.chat.tokenize import encode_rollout  # noqa: E402
from SimpleTorchLLMRL.gateway.chat import reply_view  # noqa: E402
from SimpleTorchLLMRL.recipes.calculator.arithmetic import CALCULATOR_SCHEMA, SYSTEM_PROMPT  # noqa: E402
from SimpleTorchLLMRL.tools import CalculatorError, evaluate  # noqa: E402
from tests.support.gateway_helpers import QUESTION, start  # noqa: E402

IDS = {"return_token_ids": True}  # the gateway's field: answers carry prompt_token_ids and token_ids
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# on these the embedded model calls the calculator, then answers (greedy, under each framework's tool schema)
QUESTIONS = [QUESTION, "What is 312 * 17?", "What is 128 * 46?", "What is 250 * 12?"]


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses."""
    try:
        return str(evaluate(expression))
    except CalculatorError as e:
        return f"Error: {e}"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Refuse (and report) any connection or name lookup that is not this machine's loopback."""
    attempts = []
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def guarded_connect(self, address):
        if isinstance(address, tuple) and address[0] not in LOOPBACK:
            attempts.append(("connect", address))
            raise OSError(f"test_gateway_frameworks: no network (connect to {address})")
        return connect(self, address)

    def guarded_getaddrinfo(host, *args, **kwargs):
        if host is not None and (host.decode() if isinstance(host, bytes) else host) not in LOOPBACK:
            attempts.append(("resolve", host))
            raise socket.gaierror(f"test_gateway_frameworks: no network (resolve {host})")
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
    yield
    assert not attempts, f"a framework tried to reach the network: {attempts}"


@dataclass
class Exchange:
    """One /chat/completions call as it went over the wire."""

    key: str  # the bearer API key
    request: dict
    response: dict  # the completion; a stream folded into one (see `fold_stream`)

    @property
    def prompt_ids(self) -> list[int]:
        return self.response["prompt_token_ids"]

    @property
    def ids(self) -> list[int]:
        [choice] = self.response["choices"]
        return choice["token_ids"]


def fold_stream(text: str) -> dict:
    """The server-sent chunks of one chat completion folded back into its completion's ids and message."""
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    message, ids = {"content": "", "tool_calls": []}, None
    for c in chunks:
        for choice in c.get("choices", []):
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["tool_calls"] += delta.get("tool_calls") or []
            ids = choice.get("token_ids", ids)
    choice = {"message": message, "token_ids": ids}
    return {"prompt_token_ids": chunks[0]["prompt_token_ids"], "choices": [choice]}


def record(exchanges: list, request, response) -> None:
    """Keep a successful /chat/completions exchange (request and response of httpx or httpx2)."""
    if not request.url.path.endswith("/chat/completions") or response.status_code != 200:
        return
    body = response.content.decode()
    folded = fold_stream(body) if body.startswith("data:") else json.loads(body)
    key = request.headers.get("authorization", "").removeprefix("Bearer ")
    exchanges.append(Exchange(key, json.loads(request.content), folded))


def http_libraries() -> list:
    """The HTTP libraries the frameworks speak through: httpx, and httpx2 (the openai SDK's since 3.x)."""
    import importlib

    out = []
    for name in ("httpx", "httpx2"):
        try:
            out.append(importlib.import_module(name))
        except ImportError:
            pass
    return out


@pytest.fixture
def wire(monkeypatch):
    """Every chat completion exchanged during the test (a list of `Exchange`), read at the HTTP transports.
    The answer is read whole before the framework sees it (streams included), then handed on unchanged."""
    exchanges: list[Exchange] = []
    for lib in http_libraries():
        sync_send, async_send = lib.HTTPTransport.handle_request, lib.AsyncHTTPTransport.handle_async_request

        def handle_request(self, request, send=sync_send):
            response = send(self, request)
            response.read()
            record(exchanges, request, response)
            return response

        async def handle_async_request(self, request, send=async_send):
            response = await send(self, request)
            await response.aread()
            record(exchanges, request, response)
            return response

        monkeypatch.setattr(lib.HTTPTransport, "handle_request", handle_request)
        monkeypatch.setattr(lib.AsyncHTTPTransport, "handle_async_request", handle_async_request)
    return exchanges


# ----------------------------------------------------------------------------- the check every test makes


def sampled(rollout):
    return [m for m in rollout if m.token_ids is not None]


def called(tool_calls: list[dict]) -> list[tuple]:
    """(name, parsed arguments) of OpenAI tool calls: what a call does, whatever its id and JSON spelling."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def check_rollouts(gw, tok, key: str, exchanges: list[Exchange]) -> list:
    """The key's rollouts hold exactly the exchanged calls, each call's sampled ids once, as sampled:

    - each MODEL message with ids is one call's answer (`token_ids` equal), and the rollout's encoding
      starts with that call's prompt ids followed by them (the prompt the model was conditioned on);
    - the trained tokens are exactly the sampled ids; every call is in exactly one rollout;
    - what the client was shown (content, tool calls) is what the sampled text reads as.
    Returns the rollouts."""
    mine = [e for e in exchanges if e.key == key]
    assert mine, f"no call under {key!r} went over the wire"
    rollouts, unused = gw.rollouts(key), list(mine)
    for rollout in rollouts:
        enc = encode_rollout(rollout, tok)
        for turn in sampled(rollout):
            match = [e for e in unused if e.ids == turn.token_ids
                     and enc.input_ids[: len(e.prompt_ids) + len(e.ids)] == e.prompt_ids + e.ids]
            assert match, f"a recorded turn {turn.content!r} is no call's answer under its prompt"
            e = match[0]
            unused.remove(e)
            shown = e.response["choices"][0]["message"]
            content, calls = reply_view(turn.content, e.request.get("tools"))
            assert (shown.get("content") or "").strip() == (content or "").strip()
            assert called(shown.get("tool_calls") or []) == called(calls)
        trained = [t for t, k in zip(enc.input_ids, enc.loss_mask, strict=True) if k]
        assert trained == [t for m in sampled(rollout) for t in m.token_ids]  # nothing else is trained
    assert not unused, f"{len(unused)} calls under {key!r} are in no rollout"
    return rollouts


def assert_tool_episode(rollout, question: str = QUESTION) -> None:
    """A multi-turn tool episode: the question, a sampled tool call, its result, a sampled answer."""
    assert [m.content for m in rollout if m.type is MessageType.MESSAGE] == [question]
    turns = sampled(rollout)
    assert len(turns) >= 2 and turns[0].finish_reason == "tool_call", [m.content for m in rollout]
    assert any(m.type is MessageType.TOOL for m in rollout)


def replayed_names(exchanges: list[Exchange], key: str) -> list:
    """The `name` of each assistant message the client sent back under `key` (None where it had none)."""
    return [m.get("name") for e in exchanges if e.key == key for m in e.request["messages"]
            if m["role"] == "assistant"]


# ----------------------------------------------------------------------------- LangGraph and langchain


def langchain_tool():
    from langchain_core.tools import StructuredTool

    return StructuredTool.from_function(calculate, name="calculator")


def chat_model(url: str, key: str, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=url, api_key=key, model="policy", temperature=0, extra_body=IDS, **kw)


def react_agent(url: str, key: str, name: str | None, checkpointer=None, **kw):
    import warnings

    from langgraph.prebuilt import create_react_agent

    with warnings.catch_warnings():  # LangGraph 1.x points to langchain's create_agent; both are in use
        warnings.simplefilter("ignore", DeprecationWarning)
        return create_react_agent(chat_model(url, key, **kw), [langchain_tool()], prompt=SYSTEM_PROMPT, name=name,
                                  checkpointer=checkpointer)


def langchain_agent(url: str, key: str, name: str | None, **kw):
    from langchain.agents import create_agent

    return create_agent(chat_model(url, key, **kw), [langchain_tool()], system_prompt=SYSTEM_PROMPT, name=name)


@pytest.mark.parametrize("build", [react_agent, langchain_agent], ids=["create_react_agent", "create_agent"])
@pytest.mark.parametrize("name", [None, "solver"])
def test_a_langchain_agent_tool_episode_is_one_rollout_of_the_sampled_ids(served, calc, wire, build, name):
    """Named or not: a named agent replays its earlier replies with `name`, and the episode still merges;
    the MODEL message the client replayed keeps the agent's name."""
    (gw, url), tok = served, calc[1]
    key = f"lc-{build.__name__}-{name}"
    out = build(url, key, name).invoke({"messages": [{"role": "user", "content": QUESTION}]})
    [rollout] = check_rollouts(gw, tok, key, wire)
    assert_tool_episode(rollout)
    assert out["messages"][-1].content == sampled(rollout)[-1].content  # the agent's answer is the last turn
    replayed = replayed_names(wire, key)
    assert replayed and set(replayed) == {name}  # the framework did send the name (or none)
    turns = sampled(rollout)
    assert [m.name for m in turns[:-1]] == [name] * (len(turns) - 1)  # the last reply was never sent back
    assert all(m.is_trainable for m in turns)


def test_langgraph_streamed_tokens_merge_the_same_way(served, calc, wire):
    """`stream_mode="messages"` makes ChatOpenAI stream each call; the episode is still one rollout."""
    (gw, url), tok = served, calc[1]
    agent = react_agent(url, "lg-stream", "solver", streaming=True)
    chunks = list(agent.stream({"messages": [{"role": "user", "content": QUESTION}]}, stream_mode="messages"))
    assert all(e.request.get("stream") for e in wire if e.key == "lg-stream")
    [rollout] = check_rollouts(gw, tok, "lg-stream", wire)
    assert_tool_episode(rollout)
    streamed = "".join(c.content for c, meta in chunks if meta.get("langgraph_node") == "agent")
    assert streamed.strip() == sampled(rollout)[-1].content.strip()


def test_a_follow_up_on_a_langgraph_thread_extends_the_same_rollout(served, calc, wire):
    """A checkpointed thread sends the whole history again (the named agent's replies with their name)
    with the next user message: one rollout, every reply sent back named."""
    from langgraph.checkpoint.memory import InMemorySaver

    (gw, url), tok = served, calc[1]
    agent = react_agent(url, "lg-thread", "solver", checkpointer=InMemorySaver())
    thread = {"configurable": {"thread_id": "t1"}}
    agent.invoke({"messages": [{"role": "user", "content": QUESTION}]}, thread)
    agent.invoke({"messages": [{"role": "user", "content": QUESTIONS[1]}]}, thread)
    [rollout] = check_rollouts(gw, tok, "lg-thread", wire)
    assert [m.content for m in rollout if m.type is MessageType.MESSAGE] == QUESTIONS[:2]
    turns = sampled(rollout)
    assert len(turns) >= 3 and [m.name for m in turns] == ["solver"] * (len(turns) - 1) + [None]


def test_concurrent_named_episodes_under_one_api_key_are_one_rollout_each(served, calc, wire):
    """Four episodes at once under one key (an OPENAI_API_KEY set once), two of them the same question:
    matched by conversation prefix, four rollouts, each one episode's calls."""
    (gw, url), tok = served, calc[1]
    questions = [*QUESTIONS[:3], QUESTION]
    agent = langchain_agent(url, "lc-shared", "solver")
    outs = agent.batch([{"messages": [{"role": "user", "content": q}]} for q in questions],
                       config={"max_concurrency": len(questions)})
    rollouts = check_rollouts(gw, tok, "lc-shared", wire)
    assert len(rollouts) == len(questions)
    asked = Counter(next(m.content for m in r if m.type is MessageType.MESSAGE) for r in rollouts)
    assert asked == Counter(questions)
    for out, q in zip(outs, questions, strict=True):  # each agent's answer is its own rollout's last turn
        assert any(sampled(r)[-1].content == out["messages"][-1].content and r[1].content == q for r in rollouts)
    for r in rollouts:
        assert_tool_episode(r, r[1].content)
        assert {m.name for m in sampled(r)[:-1]} == {"solver"}


# ----------------------------------------------------------------------------- pydantic-ai


def pydantic_agent(url: str, key: str):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("policy", provider=OpenAIProvider(base_url=url, api_key=key))
    agent = Agent(model, system_prompt=SYSTEM_PROMPT, model_settings={"temperature": 0, "extra_body": IDS})
    agent.tool_plain(name="calculator")(calculate)
    return agent


def test_pydantic_ai_runs_are_one_rollout_each(served, calc, wire):
    """One run, then three at once under one key (asyncio.gather): one rollout per run."""
    (gw, url), tok = served, calc[1]
    result = pydantic_agent(url, "pa-1").run_sync(QUESTION)
    [rollout] = check_rollouts(gw, tok, "pa-1", wire)
    assert_tool_episode(rollout)
    assert result.output == sampled(rollout)[-1].content

    questions = QUESTIONS[1:]
    agent = pydantic_agent(url, "pa-shared")

    async def runs():
        return await asyncio.gather(*(agent.run(q) for q in questions))

    outputs = [r.output for r in asyncio.run(runs())]
    rollouts = check_rollouts(gw, tok, "pa-shared", wire)
    assert sorted(r[1].content for r in rollouts) == sorted(questions)
    assert sorted(sampled(r)[-1].content for r in rollouts) == sorted(outputs)
    for r in rollouts:
        assert_tool_episode(r, r[1].content)


def test_a_streamed_pydantic_ai_run_is_one_rollout(served, calc, wire):
    (gw, url), tok = served, calc[1]

    async def run():
        async with pydantic_agent(url, "pa-stream").run_stream(QUESTION) as result:
            return await result.get_output()

    output = asyncio.run(run())
    assert all(e.request.get("stream") for e in wire if e.key == "pa-stream")
    [rollout] = check_rollouts(gw, tok, "pa-stream", wire)
    assert_tool_episode(rollout)
    assert output == sampled(rollout)[-1].content


# ----------------------------------------------------------------------------- litellm


def test_a_litellm_tool_loop_is_one_rollout(served, calc, wire):
    import litellm

    litellm.telemetry, litellm.suppress_debug_info = False, True
    assert not (litellm.callbacks or litellm.success_callback or litellm.failure_callback)  # nothing logs out
    (gw, url), tok = served, calc[1]
    messages = start()
    for _ in range(3):
        reply = litellm.completion(model="openai/policy", api_base=url, api_key="ll-1", messages=messages,
                                   tools=[CALCULATOR_SCHEMA], temperature=0, extra_body=IDS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            result = calculate(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    [rollout] = check_rollouts(gw, tok, "ll-1", wire)
    assert_tool_episode(rollout)
    assert messages[-1]["content"] == sampled(rollout)[-1].content


# ----------------------------------------------------------------------------- smolagents


def test_smolagents_model_calls_record_the_sampled_ids(served, calc, wire):
    """smolagents' `OpenAIServerModel`: a tool call comes back as its ChatMessage's tool_calls, and a
    conversation continued with the model's own text merges. Not run: `ToolCallingAgent` (it sends
    tool_choice="required", refused for now) and `CodeAgent` (it would execute the model's Python here,
    unsandboxed). Its agents send each step's tool calls back as text ("Calling tools: ..."), which the
    gateway cannot recognize as its reply: there every step starts a new rollout, earlier turns context."""
    from smolagents import ChatMessage, OpenAIServerModel, Tool

    class Calculator(Tool):
        name, description = "calculator", calculate.__doc__
        inputs = {"expression": {"type": "string", "description": "The arithmetic expression."}}
        output_type = "string"

        def forward(self, expression: str) -> str:
            return calculate(expression)

    (gw, url), tok = served, calc[1]
    model = OpenAIServerModel("policy", api_base=url, api_key="sm-tool", temperature=0, extra_body=IDS)
    reply = model.generate(start(), tools_to_call_from=[Calculator()], tool_choice="auto")
    [call] = reply.tool_calls
    assert call.function.name == "calculator"
    assert Calculator()(**json.loads(call.function.arguments)) == "31605"
    [rollout] = check_rollouts(gw, tok, "sm-tool", wire)
    assert len(sampled(rollout)) == 1

    model = OpenAIServerModel("policy", api_base=url, api_key="sm-chat", temperature=0, extra_body=IDS)
    messages = [ChatMessage(role=m["role"], content=[{"type": "text", "text": m["content"]}]) for m in start()]
    first = model.generate(messages)
    messages += [ChatMessage(role="assistant", content=[{"type": "text", "text": first.content}]),
                 ChatMessage(role="user", content=[{"type": "text", "text": "Are you sure?"}])]
    model.generate(messages)
    [rollout] = check_rollouts(gw, tok, "sm-chat", wire)
    assert len(sampled(rollout)) == 2 and rollout[-2].content == "Are you sure?"


# ----------------------------------------------------------------------------- OpenAI Agents SDK


def test_an_agents_sdk_chat_completions_agent_is_one_rollout(served, calc, wire):
    """The Agents SDK through `OpenAIChatCompletionsModel` (its Responses default is another route)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    (gw, url), tok = served, calc[1]

    async def run():
        client = openai.AsyncOpenAI(base_url=url, api_key="sdk-1")
        agent = Agent(name="solver", instructions=SYSTEM_PROMPT,
                      tools=[function_tool(calculate, name_override="calculator")],
                      model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                      model_settings=ModelSettings(temperature=0, extra_body=IDS))
        try:
            return (await Runner.run(agent, QUESTION, max_turns=3)).final_output
        finally:
            await client.close()

    output = asyncio.run(run())
    [rollout] = check_rollouts(gw, tok, "sdk-1", wire)
    assert_tool_episode(rollout)
    assert output == sampled(rollout)[-1].content
