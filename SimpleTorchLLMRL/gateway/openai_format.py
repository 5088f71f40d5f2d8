"""The OpenAI Chat Completions wire format: requests in, responses out (stream chunks: `gateway.streaming`).

Plain functions over JSON-ready dicts; nothing here knows about HTTP or sessions.

    parse_request(body, model_name, defaults) -> ChatRequest     (raises RequestError -> a 4xx body)
    reply_view(text, tools, parsers)         -> (content, tool_calls)
    completion_payload(...)
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.gateway.fields import (
    FieldError,
    check_fields,
    parallel_of,
    tool_choice_of,
    tool_function_of,
)
from SimpleTorchLLMRL.gateway.structured import reply_grammar
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.tools.parsers import JsonToolCallParser, ToolCall, parse_tool_calls

MAX_N = 64
MAX_SEED = 2**63 - 1  # a signed 64-bit integer, what the backends' generators take
# a generator finish_reason as OpenAI's; a turn that stopped at a tool-call stop string is "tool_calls"
# only when calls were parsed from it (`finish_reason`), else it is a plain "stop"
FINISH = {"stop": "stop", "length": "length", "tool_call": "stop"}


class RequestError(Exception):
    """A request the gateway refuses: HTTP status plus the OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad(message: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(400, message, code=code, param=param)


@dataclass
class ChatRequest:
    """One validated request. `chat`: the messages as normalized dicts (see `normalize_message`).
    `tools`: the tools offered to the template and parsed from the reply (None under tool_choice "none")."""

    chat: list[dict]
    tools: list[dict] | None
    sampling: SamplingConfig
    n: int = 1
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    template_kwargs: dict = field(default_factory=dict)
    tool_choice: str = "auto"  # "auto", "none", "required" or "function" (gateway.fields)
    tool_function: str | None = None  # the function a named tool_choice forces
    max_tokens_given: bool = True  # False: max_tokens left out, so the default shrinks to the context left
    stop: tuple[str, ...] = ()  # the request's own stop strings: left out of the content it is shown (OpenAI's)


# ----------------------------------------------------------------------------- requests


def check_body(body, model_name: str) -> None:
    """A request body is a JSON object asking for the served model (or none): else a 400, or a 404 naming it."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise RequestError(404, f"The model '{model}' does not exist; this gateway serves '{model_name}'",
                           code="model_not_found", param="model")


def sse_response(chunks):
    """Server-sent events of `chunks` (JSON payloads), then OpenAI's `[DONE]`."""
    from fastapi.responses import StreamingResponse

    async def events():
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def number_field(body: dict, key: str, lo: float, hi: float, default):
    """body[key], a number in [lo, hi], or `default` when absent; a 400 naming the field otherwise."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise bad(f"'{key}' must be a number in [{lo}, {hi}], got {value!r}", key)
    return value


def sampling_controls(body: dict, defaults: SamplingConfig, vocab_size: int | None) -> dict:
    """logit_bias, frequency_penalty, presence_penalty and min_p of a request as `SamplingConfig` keywords (the
    defaults' where the request leaves them out), in OpenAI's ranges: penalties in [-2, 2]; bias keys token
    ids as integer strings, below `vocab_size` when given, values in [-100, 100]; min_p (vLLM's extension
    field, 0 disables) in [0, 1]. A 400 naming the field otherwise."""
    out = {key: number_field(body, key, -2, 2, getattr(defaults, key))
           for key in ("frequency_penalty", "presence_penalty")}
    out["min_p"] = number_field(body, "min_p", 0, 1, defaults.min_p)
    bias = body.get("logit_bias")
    if bias is None:
        return {**out, "logit_bias": defaults.logit_bias}
    if not isinstance(bias, dict):
        raise bad(f"'logit_bias' must be an object of token ids (integer strings) to numbers in [-100, 100], got "
                  f"{bias!r:.80}", "logit_bias")
    pairs: dict[int, float] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise bad(f"'logit_bias' keys must be token ids written as integer strings, got {key!r:.40}", "logit_bias")
        tok = int(key)
        if vocab_size is not None and tok >= vocab_size:
            raise bad(f"'logit_bias' names token id {tok}, outside this model's vocabulary [0, {vocab_size})",
                      "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad(f"'logit_bias[\"{key}\"]' must be a number in [-100, 100], got {value!r:.40}", "logit_bias")
        if tok in pairs:
            raise bad(f"'logit_bias' names token id {tok} twice", "logit_bias")
        pairs[tok] = float(value)
    out["logit_bias"] = pairs
    return out


def int_field(body: dict, key: str, lo: int, hi: int | None, default):
    """body[key], an integer in [lo, hi] (no upper bound when hi is None), or `default`; else a 400."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        raise bad(f"'{key}' must be an integer >= {lo}{'' if hi is None else f' and <= {hi}'}, got {value!r}", key)
    return value


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
        raise bad(f"{where}: unknown role {role!r}; expected system, developer, user, assistant or tool", "messages")
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
        calls = turn["tool_calls"]
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
        out["tool_calls"] = norm
    if role == "tool":
        if turn.get("tool_call_id") is not None and not isinstance(turn.get("tool_call_id"), str):
            raise bad(f"{where}: tool_call_id must be a string", "messages")
        if turn.get("tool_call_id"):
            out["tool_call_id"] = turn["tool_call_id"]
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}} objects", "tools")
    return tools


def parse_request(body: Any, model_name: str, defaults: SamplingConfig, vocab_size: int | None = None,
                  tool_parsers: Sequence | None = None) -> ChatRequest:
    """Validate a /v1/chat/completions body. Options the request leaves out keep the generator's; a field
    the gateway does not honour is refused with a 400 naming it unless it asks for nothing (`gateway.fields`).
    tool_choice "none": the tools are neither offered to the template nor parsed from the reply.
    vocab_size: the ids logit_bias may name (None: not checked here; the backend checks at generate).
    response_format, tool_choice "required" / a named function and parallel_tool_calls false become the
    call's grammar (`gateway.structured`; tool_parsers: the gateway's, the format a forced call is written in)."""
    check_body(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' is required: a non-empty list of messages", "messages")
    chat = [normalize_message(m, i) for i, m in enumerate(messages)]
    tools = _tools(body)
    try:  # every other field is honoured below, accepted as metadata, or refused here (gateway.fields)
        check_fields(body)
        tool_choice = tool_choice_of(body, tools)
        tool_function = tool_function_of(body) if tool_choice == "function" else None
        grammar = reply_grammar(body.get("response_format"), tools, tool_choice, tool_function, parallel_of(body),
                                tool_parsers)
    except FieldError as e:
        raise bad(e.message, e.param, e.code) from e
    max_tokens = int_field(body, "max_completion_tokens", 1, None, None)
    max_tokens = int_field(body, "max_tokens", 1, None, max_tokens if max_tokens is not None else defaults.max_new_tokens)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and len(stop) <= 4
                                                           and all(isinstance(s, str) and s for s in stop))):
        raise bad("'stop' must be a string or a list of at most 4 non-empty strings", "stop")
    stop = tuple([stop] if isinstance(stop, str) else stop or [])
    controls = sampling_controls(body, defaults, vocab_size)
    try:
        sampling = SamplingConfig(
            max_new_tokens=max_tokens, temperature=number_field(body, "temperature", 0, 2, defaults.temperature),
            do_sample=defaults.do_sample, top_p=number_field(body, "top_p", 0, 1, defaults.top_p) or None,
            top_k=defaults.top_k, stop=tuple(defaults.stop) + stop,
            tool_call_stop=defaults.tool_call_stop, eos_token_ids=defaults.eos_token_ids,
            grammar=grammar if grammar is not None else defaults.grammar, **controls)
    except ValueError as e:
        raise bad(str(e)) from e
    top = int_field(body, "top_logprobs", 0, 20, 0)
    if top and not body.get("logprobs"):
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or not set(stream_options) <= {"include_usage", "include_obfuscation"}:
        raise bad("'stream_options' must be an object of include_usage and include_obfuscation (chunks are never "
                  f"padded here, so the latter has no effect); got {stream_options!r}", "stream_options")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return ChatRequest(chat=chat, tools=None if tool_choice == "none" else tools, sampling=sampling,
                       n=int_field(body, "n", 1, MAX_N, 1),
                       seed=int_field(body, "seed", 0, MAX_SEED, None), stream=bool(body.get("stream")),
                       include_usage=bool(stream_options.get("include_usage")),
                       logprobs=bool(body.get("logprobs")), top_logprobs=top,
                       return_token_ids=bool(body.get("return_token_ids")), template_kwargs=kwargs,
                       tool_choice=tool_choice, tool_function=tool_function, stop=stop,
                       max_tokens_given=body.get("max_tokens") is not None
                       or body.get("max_completion_tokens") is not None)


def to_message(turn: dict) -> Message:
    """A normalized message as a `Message`. An assistant turn the client sent is context: not trained."""
    kind = MessageType.from_role(turn["role"])
    return Message(turn["content"], kind, name=turn.get("name"), tool_calls=turn.get("tool_calls"),
                   tool_call_id=turn.get("tool_call_id"), trainable=False if kind is MessageType.MODEL else None)


# ----------------------------------------------------------------------------- replies


def without_stop(text: str, stops) -> str:
    """The text up to the first of the request's stop strings (OpenAI leaves the stop out of what it returns;
    the recorded ids and MODEL message keep it, as sampled)."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


def shown_text(msg: Message, stops: Sequence[str]) -> str:
    """The sampled text of a reply as the client gets it: without the request's own stop string where one
    ended it (a generator's own stop strings and tool-call stops stay: they are the model's text)."""
    return without_stop(msg.content, stops) if stops and msg.finish_reason == "stop" else msg.content


def reply_view(text: str, tools: list[dict] | None, parsers: Sequence | None = None):
    """(content, tool_calls) the client is shown for a sampled text: with tools, well-formed calls become
    OpenAI tool_calls and leave the content; any malformed call leaves the whole text as content."""
    if not tools:
        return text, []
    calls = parse_tool_calls(text, parsers or [JsonToolCallParser()])
    if not calls or any(c.error for c in calls):
        return text, []
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


def finish_reason(sampled: str | None, tool_calls: list[dict]) -> str:
    """OpenAI's finish_reason of a reply: "tool_calls" exactly when the reply shows tool calls (clients
    iterate over them on that value), else the generator's reason ("stop", "length"; a turn cut at a
    tool-call stop string whose call is not shown, e.g. no tools offered or a malformed call: "stop")."""
    if tool_calls:
        return "tool_calls"
    if sampled is not None and sampled not in FINISH:
        raise ValueError(f"unknown finish_reason {sampled!r}; expected one of {sorted(FINISH)} or None")
    return FINISH[sampled or "stop"]


def logprobs_payload(tokenizer, ids: list[int], logprobs: list[float], top: list | None) -> dict:
    """OpenAI `choice.logprobs`: one entry per sampled token (decoded text, bytes, log-prob, top alternatives)."""
    def entry(tok: int, lp: float) -> dict:
        text = tokenizer.decode([tok])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for k, (tok, lp) in enumerate(zip(ids, logprobs, strict=True)):
        e = entry(tok, lp)
        e["top_logprobs"] = [entry(t, v) for t, v in top[k]] if top is not None else []
        content.append(e)
    return {"content": content, "refusal": None}


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion_payload(rid: str, model: str, choices: list[dict], prompt_ids: list[int],
                       return_token_ids: bool) -> dict:
    """A `chat.completion` object. choices: dicts with index, message, finish_reason, logprobs, token_ids."""
    completion = sum(len(c["token_ids"]) for c in choices)
    out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
           "choices": [{k: v for k, v in c.items() if k != "token_ids" or return_token_ids} for c in choices],
           "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                     "total_tokens": len(prompt_ids) + completion}}
    if return_token_ids:
        out["prompt_token_ids"] = list(prompt_ids)
    return out


def top_logprobs(generator, prompt_ids: list[int], msg: Message, k: int) -> list[list[tuple[int, float]]]:
    """The k most likely ids and their log-probs at each sampled position, under the same temperature
    as the recorded log-probs (the backend's `top_logprobs`; callers check `supports_top_logprobs`)."""
    return generator.backend.top_logprobs(list(prompt_ids), list(msg.token_ids), msg.temperature or 1.0, k)
