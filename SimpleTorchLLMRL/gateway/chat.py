"""POST /v1/chat/completions at the two ends of the pipeline: `parse` (wire -> `GenRequest`) and `render`
(`Result` -> the `chat.completion` object); its stream is `streaming.chat_stream`.

Every field is honoured, or refused with a 400 whose `param` names it (docs/gateway.md, "Every request
field").
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from SimpleTorchLLMRL.chat.message import Message, Rollout
from SimpleTorchLLMRL.gateway.request import (
    FINISH,
    MAX_N,
    MAX_SEED,
    Choice,
    GenRequest,
    Result,
    bad,
    bool_field,
    check_body,
    check_fields,
    int_field,
    sampling_of,
    stop_field,
    without_stop,
)
from SimpleTorchLLMRL.tools.parsers import JsonToolCallParser, ToolCall, parse_tool_calls

MAX_TOOLS = 128  # OpenAI's limit on `tools`; checked before any template or grammar sees them

# read by `parse` and applied to the reply (return_token_ids, chat_template_kwargs: the gateway's own)
HONOURED = frozenset({
    "model", "messages", "tools", "tool_choice", "temperature", "top_p", "n", "max_tokens", "max_completion_tokens",
    "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "return_token_ids", "chat_template_kwargs",
    "logit_bias", "frequency_penalty", "presence_penalty", "min_p",  # min_p: vLLM's extension field
    "response_format", "parallel_tool_calls",
})
# accepted; they identify, tag or route a request at OpenAI and change nothing that is sampled here
NO_EFFECT = frozenset({
    "user", "safety_identifier", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options",
})
SERVICE_TIERS = (None, "auto", "default")


def _unset(value: Any) -> bool:
    return value is None


# field -> (is the value the default, i.e. a request that asks for nothing; why it is refused otherwise)
REFUSED_UNLESS_DEFAULT = {
    "functions": (lambda v: v is None or v == [], "the legacy 'functions' field is not supported: use 'tools'"),
    "function_call": (_unset, "the legacy 'function_call' field is not supported: use 'tool_choice'"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported: modalities must be [\"text\"]"),
    "audio": (_unset, "audio output is not supported"),
    "prediction": (_unset, "predicted outputs are not supported"),
    "reasoning_effort": (_unset, "reasoning_effort is not supported; a template's thinking switch, if it has one, "
                                 "goes in chat_template_kwargs (e.g. {\"enable_thinking\": false})"),
    "verbosity": (_unset, "verbosity is not supported"),
    "web_search_options": (_unset, "web search is not supported"),
    "moderation": (_unset, "moderation is not supported: replies are not screened"),
}


@dataclass(frozen=True)
class ChatOptions:
    """What the chat render reads of a request (`GenRequest.options`)."""

    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    tool_choice: str = "auto"  # "auto", "none", "required" or "function"


# ----------------------------------------------------------------------------- parse


def parse(body: Any, ctx) -> GenRequest:
    """A /v1/chat/completions body as a `GenRequest` (`ctx`: the gateway's `Context`). Options the request
    leaves out keep the generator's; tool_choice "none": the tools are neither offered to the template nor
    parsed from the reply."""
    check_body(body, ctx.model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' is required: a non-empty list of messages", "messages")
    chat = [normalize_message(m, i) for i, m in enumerate(messages)]
    check_fields(body, HONOURED, NO_EFFECT, REFUSED_UNLESS_DEFAULT)
    _check_no_effect(body)
    tools = _tools(body)
    tool_choice = tool_choice_of(body, tools)
    parallel = bool_field(body, "parallel_tool_calls", True)
    grammar = None
    if body.get("response_format") is not None or tool_choice in ("required", "function") or (tools and not parallel):
        from SimpleTorchLLMRL.gateway.structured import grammar_spec

        grammar = grammar_spec(body.get("response_format"), tools, tool_choice, tool_function_of(body), parallel,
                               ctx.tool_parsers)
    top = int_field(body, "top_logprobs", 0, 20, 0)
    logprobs = bool_field(body, "logprobs")
    if top and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if top and not ctx.supports_top_logprobs:
        raise bad("top_logprobs needs the HF backend (this gateway runs vLLM); use logprobs without it",
                  "top_logprobs")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or not set(stream_options) <= {"include_usage", "include_obfuscation"}:
        raise bad("'stream_options' must be an object of include_usage and include_obfuscation (chunks are never "
                  f"padded here, so the latter has no effect); got {stream_options!r:.200}", "stream_options")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    max_tokens = int_field(body, "max_completion_tokens", 1, None, None)
    max_tokens = int_field(body, "max_tokens", 1, None, max_tokens)
    stop = stop_field(body)
    options = ChatOptions(bool_field(stream_options, "include_usage"), logprobs,
                          bool_field(body, "return_token_ids"), tool_choice)
    return GenRequest(
        sampling=sampling_of(body, ctx.defaults, ctx.vocab_size, max_tokens or ctx.defaults.max_new_tokens, stop),
        messages=chat, tools=None if tool_choice == "none" else tools, template_kwargs=kwargs,
        n=int_field(body, "n", 1, MAX_N, 1), seed=int_field(body, "seed", 0, MAX_SEED, None),
        stream=bool_field(body, "stream"), top_logprobs=top, max_tokens_given=max_tokens is not None, stop=stop,
        grammar=grammar, options=options)


def _check_no_effect(body: dict) -> None:
    tier, meta = body.get("service_tier"), body.get("metadata")
    if tier not in SERVICE_TIERS:
        raise bad(f"service_tier {tier!r:.80} is not supported; use 'auto' or 'default' (it has no effect on "
                  "sampling here)", "service_tier", "unsupported_value")
    if meta is not None and not isinstance(meta, dict):
        raise bad("'metadata' must be an object of string keys and values", "metadata", "invalid_type")


def _arguments(raw: Any, where: str) -> dict:
    """Tool-call arguments as an object: OpenAI sends a JSON string, templates want the object."""
    if isinstance(raw, dict):
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise bad(f"{where}: function.arguments is not valid JSON: {e}", "messages") from e
        if isinstance(value, dict):
            return value
    raise bad(f"{where}: function.arguments must be a JSON object (or its JSON string)", "messages")


def normalize_message(turn: Any, i: int) -> dict:
    """An OpenAI message -> {role, content (str), name?, tool_calls? [{id, type, function{name, arguments}}],
    tool_call_id?}: text parts joined, "developer" as "system", arguments parsed to objects."""
    where = f"messages[{i}]"
    if not isinstance(turn, dict):
        raise bad(f"{where} must be an object, got {type(turn).__name__}", "messages")
    role = turn.get("role")
    role = "system" if role == "developer" else role
    if role not in ("system", "user", "assistant", "tool"):
        raise bad(f"{where}: unknown role {role!r:.40}; expected system, developer, user, assistant or tool",
                  "messages")
    if turn.get("content") is None and not (role == "assistant" and turn.get("tool_calls")):
        need = "an assistant message without tool_calls" if role == "assistant" else f"a {role} message"
        raise bad(f"{where}.content is missing: {need} needs content", f"{where}.content")
    try:  # text parts and None content, as Rollout.from_chat reads them
        content = Rollout.from_chat([{"role": role, "content": turn.get("content")}])[0].content
    except (ValueError, TypeError) as e:
        raise bad(f"{where}: {e}", "messages") from e
    out: dict[str, Any] = {"role": role, "content": content}
    if isinstance(turn.get("name"), str):
        out["name"] = turn["name"]
    if role == "assistant" and turn.get("tool_calls"):
        out["tool_calls"] = _calls(turn["tool_calls"], where)
    if role == "tool":
        if turn.get("tool_call_id") is not None and not isinstance(turn.get("tool_call_id"), str):
            raise bad(f"{where}: tool_call_id must be a string", "messages")
        if turn.get("tool_call_id"):
            out["tool_call_id"] = turn["tool_call_id"]
    return out


def _calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(f"{where}: tool_calls must be a list", "messages")
    norm = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}.tool_calls[{j}] needs function.name", "messages")
        norm.append({"id": str(call.get("id") or f"call_{j}"), "type": "function",
                     "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"),
                                                                              f"{where}.tool_calls[{j}]")}})
    return norm


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise bad(f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS} per request", "tools", "array_above_max_length")
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}} objects", "tools")
    return tools


def tool_choice_of(body: dict, tools: list[dict] | None) -> str:
    """The request's tool_choice: "auto" (the default: tools offered, calls parsed), "none" (tools not offered
    to the template, no call parsed from the reply), "required" (one or more calls of the offered tools) or
    "function" (calls of the one named, `tool_function_of`); the last two need tools, and a named function
    must be one of them."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    offered = [t["function"]["name"] for t in tools or []]
    if choice == "required":
        if not offered:
            raise bad("tool_choice 'required' needs 'tools' to call", "tool_choice", "invalid_value")
        return "required"
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = tool_function_of(body)
        if name not in offered:
            raise bad(f"tool_choice names the function {name!r:.80}, which is not among the request's tools",
                      "tool_choice", "invalid_value")
        return "function"
    raise bad(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
              f"{{\"name\": ...}}}}; got {choice!r:.200}", "tool_choice", "invalid_value")


def tool_function_of(body: dict) -> str | None:
    """The function name of a tool_choice {"type": "function", "function": {"name": N}}, else None."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad("tool_choice {\"type\": \"function\"} needs function.name", "tool_choice", "invalid_value")
    return name


# ----------------------------------------------------------------------------- the reply's tool calls


def tool_openings(parsers: Sequence | None) -> tuple[str, ...] | None:
    """The texts a tool call starts with under `parsers` (default: Hermes' `<tool_call>`); None when a parser
    does not say (then a reply with tools offered is shown only once it is complete)."""
    if not parsers:
        return ("<tool_call>",)
    out = []
    for p in parsers:
        if isinstance(getattr(p, "open_tag", None), str):
            out.append(p.open_tag)
        elif hasattr(p, "tags") and type(p).__name__ == "TagToolCallParser":
            out.extend(f"<{t}>" for t in p.tags)
        elif type(p).__name__ == "CodeBlockParser":
            out.append("```")
        else:
            return None
    return tuple(out)


def held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start (not the whole) of one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def _without_cut_call(text: str, parsers) -> str:
    """A reply cut by max_tokens without the call it was writing: from the last call opening that no
    well-formed call follows, or a trailing start of an opening."""
    openings = tool_openings(parsers) or ()
    text = text[: len(text) - held_suffix(text, openings)]
    at = max((text.rfind(o) for o in openings), default=-1)
    if at >= 0:
        tail = parse_tool_calls(text[at:], parsers)
        if not tail or any(c.error for c in tail) or tail[-1].span[1] < len(text[at:].rstrip()):
            text = text[:at]
    return text


def reply_view(text: str, tools: list[dict] | None, parsers: Sequence | None = None, cut: bool = False):
    """(content, tool_calls) the client is shown for a sampled text: with tools, well-formed calls become
    OpenAI tool_calls and leave the content; any malformed call leaves the whole text as content. cut: the
    reply ended at max_tokens, so a call it was writing is dropped (no fragment of it is shown)."""
    if not tools:
        return text, []
    parsers = parsers or [JsonToolCallParser()]
    if cut:
        text = _without_cut_call(text, parsers)
    calls = parse_tool_calls(text, parsers)
    if not calls or any(c.error for c in calls):
        return (text.strip() or None) if cut else text, []
    content, last = [], 0
    for c in calls:
        content.append(text[last:c.span[0]])
        last = c.span[1]
    content.append(text[last:])
    body = "".join(content).strip()
    return (body or None), [wire_call(c) for c in calls]


def wire_call(call: ToolCall) -> dict:
    """A parsed call as the Chat Completions API sends it: `ToolCall.to_openai()` (the chat-template form,
    arguments a dict) with a fresh id and the arguments as a JSON string."""
    shown = call.to_openai()
    shown["function"]["arguments"] = json.dumps(shown["function"]["arguments"], ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", **shown}


def reply_choice(index: int, msg: Message, req: GenRequest, parsers: Sequence | None, prompt: int = 0) -> Choice:
    """What the client is shown of a sampled reply: its text without the request's own stop string where one
    ended it; with tools offered, well-formed calls as OpenAI tool_calls (any malformed call: the whole text
    as content). A reply cut by max_tokens inside a call shows the calls it completed and no fragment of the
    cut one, with finish_reason "length"."""
    text = msg.content
    if req.stop and msg.finish_reason == "stop":
        text = without_stop(text, req.stop)
    calls: list[dict] = []
    if req.tools:
        text, calls = reply_view(text, req.tools, parsers, cut=msg.finish_reason == "length")
    if calls:
        finish = "length" if msg.finish_reason == "length" else "tool_calls"
    else:
        finish = FINISH.get(msg.finish_reason or "stop")
        if finish is None:
            raise ValueError(f"unknown finish_reason {msg.finish_reason!r}; expected one of {sorted(FINISH)}")
    return Choice(index, msg, text, calls, finish, prompt)



# ----------------------------------------------------------------------------- render


def render(result: Result, req: GenRequest, ctx) -> dict:
    """The `chat.completion` object of a finished call."""
    opts: ChatOptions = req.options
    out = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
           "model": ctx.model_name, "choices": [choice_object(c, opts, ctx.tokenizer) for c in result.choices],
           "usage": result.usage()}
    if opts.return_token_ids:
        out["prompt_token_ids"] = list(result.prompt_ids[0])
    return out


def choice_object(c: Choice, opts: ChatOptions, tokenizer) -> dict:
    message = {"role": "assistant", "content": c.content}
    if c.tool_calls:
        message["tool_calls"] = c.tool_calls
    out = {"index": c.index, "message": message, "finish_reason": c.finish_reason,
           "logprobs": logprobs_payload(tokenizer, c.message.token_ids, c.message.logprobs, c.top)
           if opts.logprobs else None}
    if opts.return_token_ids:
        out["token_ids"] = list(c.message.token_ids)
    return out


def logprobs_payload(tokenizer, ids: list[int], logprobs: list[float], top: list | None) -> dict:
    """OpenAI `choice.logprobs`: one entry per sampled token (decoded text, bytes, log-prob, top alternatives)."""
    def entry(tok: int, lp: float) -> dict:
        text = tokenizer.decode([tok])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

    content = []
    for k, (tok, lp) in enumerate(zip(ids, logprobs, strict=True)):
        e = entry(tok, lp)
        e["top_logprobs"] = [entry(t, v) for t, v in top[k]] if top is not None else []
        content.append(e)
    return {"content": content, "refusal": None}
