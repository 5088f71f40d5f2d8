"""The OpenAI Responses API wire format, translated onto the Chat Completions path: plain functions over
JSON-ready dicts; the route is `gateway.responses_route`.

    chat_body(body, history) -> (chat completions body, the new messages)   (RequestError -> a 400)
    response_object(...)      -> {"id": "resp_...", "object": "response", "output": [...], ...}
    stream_events(start, message_id, deltas, finish) -> the response.* events, in order

How input items map onto chat messages, and every field's fate: docs/gateway.md, "The Responses API".
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from SimpleTorchLLMRL.gateway.request import RequestError, bad, check_fields, int_field

# read here and translated to the chat body (return_token_ids, chat_template_kwargs: the gateway's own)
HONOURED = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "temperature", "top_p", "max_output_tokens",
    "parallel_tool_calls", "stream", "stream_options", "previous_response_id", "include", "top_logprobs", "text",
    "store", "return_token_ids", "chat_template_kwargs",
})
# passed to the chat path as they are: accepted there without effect on sampling (chat.NO_EFFECT)
PASSED = frozenset({"metadata", "user", "safety_identifier", "service_tier", "prompt_cache_key",
                    "prompt_cache_retention", "prompt_cache_options"})
# field -> (the values that ask for nothing, why any other is refused)
REFUSED_UNLESS_DEFAULT: dict[str, tuple[tuple, str]] = {
    "reasoning": ((None,), "reasoning is not supported: only null is accepted (a template's thinking switch goes "
                          "in chat_template_kwargs)"),
    "truncation": ((None, "disabled"), "truncation 'auto' is not supported: a conversation past the context is a "
                                       "400, never silently cut; use 'disabled'"),
    "background": ((None, False), "background responses are not supported"),
    "background_options": ((None,), "background responses are not supported"),
    "conversation": ((None,), "conversations are not stored here: send the items, or previous_response_id"),
    "prompt": ((None,), "stored prompt templates are not supported"),
    "max_tool_calls": ((None,), "max_tool_calls is not enforced (no built-in tools run here)"),
    "context_management": ((None, []), "context_management is not supported"),
    "moderation": ((None,), "moderation is not supported: replies are not screened"),
    "access_programs": ((None,), "access_programs are not supported"),
    "image": ((None,), "image generation is not supported"),
}
# the same, as `check_fields` takes it (a value equal to an allowed one and of its type: 0 is not False)
_REFUSED = {key: (lambda v, allowed=allowed: any(v == a and type(v) is type(a) for a in allowed), why)
            for key, (allowed, why) in REFUSED_UNLESS_DEFAULT.items()}
# Responses includables honoured here; every other one is refused
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# a chat parameter's name as the Responses request spells it, for the chat path's 400s
CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
               "verbosity": "text.verbosity", "logprobs": "include"}
MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}  # id, status, phase: informational
CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status"}
OUTPUT_KEYS = {"type", "call_id", "output", "id", "status", "name"}
TEXT_PART_KEYS = {"type", "text", "annotations", "logprobs"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ----------------------------------------------------------------------------- requests


def _extra_keys(item: dict, known: set, where: str) -> None:
    """An item key this gateway does not know, set to a value: a 400 naming it (null is accepted)."""
    for key, value in item.items():
        if key not in known and value is not None:
            raise bad(f"{where}.{key} is not supported here", f"{where}.{key}", "unknown_parameter")


def _text(content: Any, where: str, kinds: tuple[str, ...], key: str = "content") -> str:
    """An item's text (its `key`): a string, or text parts of the given types joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.{key} must be a string or a list of {' / '.join(kinds)} parts", f"{where}.{key}")
    out = []
    for j, part in enumerate(content):
        at = f"{where}.{key}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise bad(f"{at}.type is {kind!r}: only text parts ({', '.join(kinds)}) are supported here (no images, "
                      "files or audio)", f"{at}.type", "unsupported_value")
        if not isinstance(part.get("text"), str):
            raise bad(f"{at}.text must be a string", f"{at}.text")
        _extra_keys(part, TEXT_PART_KEYS, at)
        out.append(part["text"])
    return "".join(out)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad(f"{where}.{key} is required: a non-empty string", f"{where}.{key}")
    return value


def _arguments(item: dict, where: str) -> str:
    """A function call's arguments: a JSON object, as its string."""
    raw = item.get("arguments")
    try:
        ok = isinstance(raw, str) and isinstance(json.loads(raw or "{}"), dict)
    except ValueError:
        ok = False
    if not ok:
        raise bad(f"{where}.arguments must be a JSON object as a string, got {raw!r:.80}", f"{where}.arguments")
    return raw or "{}"


def input_messages(value: Any) -> list[dict]:
    """`input` as chat messages (docs/gateway.md, "The Responses API"): a string is one user message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("'input' is required: a string or a non-empty list of items", "input")
    chat: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object, got {type(item).__name__}", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _extra_keys(item, MESSAGE_KEYS, where)
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{where}.role must be user, system, developer or assistant, got {role!r}", f"{where}.role")
            if role == "assistant":
                chat.append({"role": "assistant", "content": _text(item.get("content"), where,
                                                                   ("output_text", "input_text"))})
            else:
                chat.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), where, ("input_text",))})
        elif kind == "function_call":
            _extra_keys(item, CALL_KEYS, where)
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _arguments(item, where)}}
            if chat and chat[-1]["role"] == "assistant":  # the turn's calls follow its text, as this gateway answers
                chat[-1].setdefault("tool_calls", []).append(call)
            else:
                chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _extra_keys(item, OUTPUT_KEYS, where)
            text = _text(item.get("output"), where, ("input_text",), key="output")
            chat.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        else:
            raise bad(f"{where}.type {kind!r} is not supported: input items are messages, function_call and "
                      "function_call_output", f"{where}.type", "unsupported_value")
    return chat


def chat_tools(tools: Any) -> list[dict] | None:
    """Responses function tools ({"type": "function", "name", "description", "parameters", "strict"}) in the
    chat shape: the function, as given, is what the template renders, as on the chat path (`strict` is passed
    on like any key; arguments are not constrained)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad(f"tools[{i}].type is {kind!r}: only function tools are supported here (no hosted or built-in "
                      "tools)", "tools", "unsupported_value")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad(f"tools[{i}].name is required: a non-empty string", "tools")
        if t.get("parameters") is not None and not isinstance(t["parameters"], dict):
            raise bad(f"tools[{i}].parameters must be a JSON schema object", "tools")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """tool_choice in the chat shape: "none" / "auto" / "required" as they are, {"type": "function", "name"}
    as {"type": "function", "function": {"name"}} (the chat path enforces or refuses it)."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"name\": ...}}; "
              f"got {choice!r}", "tool_choice", "unsupported_value")


def response_format(fmt: Any) -> dict | None:
    """text.format as the chat path's response_format ({"type": "text"} asks for nothing)."""
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise bad(f"text.format must be {{\"type\": \"text\"}}, json_object or json_schema, got {fmt!r}", "text.format")


def _text_config(text: Any) -> dict:
    """The chat fields of `text`: format (response_format) and verbosity."""
    if text is None:
        return {}
    if not isinstance(text, dict) or not set(text) <= {"format", "verbosity"}:
        raise bad(f"'text' must be an object of format and verbosity, got {text!r}", "text")
    out = {}
    fmt = response_format(text.get("format"))
    if fmt is not None:
        out["response_format"] = fmt
    if text.get("verbosity") is not None:
        out["verbosity"] = text["verbosity"]
    return out


def _include(body: dict) -> bool:
    """Whether log-probs are asked for: include holds LOGPROBS_INCLUDE (others are refused), or top_logprobs."""
    include = body.get("include")
    if include is not None and not isinstance(include, list):
        raise bad("'include' must be a list", "include")
    for value in include or []:
        if value != LOGPROBS_INCLUDE:
            raise bad(f"include {value!r} is not available here; only {LOGPROBS_INCLUDE!r} is", "include",
                      "unsupported_value")
    return LOGPROBS_INCLUDE in (include or []) or bool(body.get("top_logprobs"))


def chat_body(body: Any, history: list[dict]) -> tuple[dict, list[dict]]:
    """The Chat Completions body that answers a Responses request, and the request's new messages (its
    input items). history: the conversation of its previous_response_id (none: []), before the new items."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_fields(body, HONOURED, PASSED, _REFUSED)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("'instructions' must be a string", "instructions")
    for key in ("stream", "store"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise bad(f"'{key}' must be a boolean", key)
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_obfuscation"}):
        raise bad("'stream_options' may only hold include_obfuscation (events are never padded here, so it has "
                  f"no effect); got {options!r}", "stream_options")
    new = input_messages(body.get("input"))
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat = {"messages": [*system, *history, *new], "stream": False,
            "max_tokens": int_field(body, "max_output_tokens", 1, None, None),
            "tools": chat_tools(body.get("tools")), "tool_choice": chat_tool_choice(body.get("tool_choice")),
            "logprobs": _include(body), **_text_config(body.get("text"))}
    for key in ("model", "temperature", "top_p", "parallel_tool_calls", "top_logprobs", "return_token_ids",
                "chat_template_kwargs", *PASSED):
        if key in body:
            chat[key] = body[key]
    return {k: v for k, v in chat.items() if v is not None}, new


def as_responses_error(e: RequestError) -> RequestError:
    """A chat-path 400 with its `param` as the Responses request spells it (messages -> input, ...)."""
    param = e.param
    if param is not None:
        head = param.split("[")[0].split(".")[0]
        param = "input" if head == "messages" else CHAT_PARAMS.get(param, param)
    return RequestError(e.status, e.message, e.type, e.code, param)


# ----------------------------------------------------------------------------- responses


def reply_message(choice: dict) -> dict:
    """The chat message the client was shown for a choice, with arguments as JSON strings: the next turn
    of a previous_response_id conversation."""
    msg = choice["message"]
    out = {"role": "assistant", "content": msg.get("content")}
    if msg.get("tool_calls"):
        out["tool_calls"] = msg["tool_calls"]
    return out


def output_items(choice: dict, message_id: str, logprobs: bool) -> list[dict]:
    """A chat choice as Responses output items: a `message` with one output_text (its content, left out when
    the reply is tool calls only), then one `function_call` per tool call."""
    msg, incomplete = choice["message"], choice["finish_reason"] == "length"
    items = []
    if msg.get("content") is not None or not msg.get("tool_calls"):
        part = {"type": "output_text", "text": msg.get("content") or "", "annotations": []}
        if logprobs:  # every sampled token of the turn (a tool call's text included), as the chat path gives them
            part["logprobs"] = (choice.get("logprobs") or {}).get("content") or []
        items.append({"id": message_id, "type": "message", "role": "assistant",
                      "status": "incomplete" if incomplete else "completed", "content": [part]})
    for call in msg.get("tool_calls") or []:
        items.append({"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call",
                      "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def response_object(rid: str, model: str, body: dict, payload: dict | None, message_id: str, *,
                    created_at: int) -> dict:
    """The Response for a Responses request `body` answered by the chat completion `payload` (None: the
    response in progress, no output yet). Echoes the request's settings as OpenAI does."""
    out = {"id": rid, "object": "response", "created_at": created_at, "status": "in_progress", "error": None,
           "incomplete_details": None, "instructions": body.get("instructions"),
           "max_output_tokens": body.get("max_output_tokens"), "model": model, "output": [],
           "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
           "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
           "store": body.get("store") is not False, "temperature": body.get("temperature"),
           "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice") or "auto",
           "tools": body.get("tools") or [], "top_p": body.get("top_p"),
           "truncation": body.get("truncation") or "disabled", "usage": None, "user": body.get("user"),
           "metadata": body.get("metadata") or {}}
    if payload is None:
        return out
    [choice] = payload["choices"]
    out["output"] = output_items(choice, message_id, bool(choice.get("logprobs")))
    if choice["finish_reason"] == "length":
        out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        out["status"] = "completed"
    usage = payload["usage"]
    out["usage"] = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": usage["total_tokens"]}
    if "prompt_token_ids" in payload:  # return_token_ids: the gateway's own fields, vLLM's spelling
        out["prompt_token_ids"], out["token_ids"] = payload["prompt_token_ids"], choice["token_ids"]
    return out


def _with_streamed(final: dict, message_id: str, streamed: list[str] | None) -> dict:
    """The final Response, with the text that was streamed as its first item where the reply does not show it
    (deltas must be the shown text; what was seen stays, as streamed)."""
    if streamed is None or any(item["type"] == "message" for item in final["output"]):
        return final
    part = {"type": "output_text", "text": "".join(streamed), "annotations": []}
    item = {"id": message_id, "type": "message", "role": "assistant", "status": "completed", "content": [part]}
    return {**final, "output": [item, *final["output"]]}


async def stream_events(start: dict, message_id: str, deltas: AsyncIterator[str],
                        finish: Callable[[], Awaitable[dict]]) -> AsyncIterator[dict]:
    """The Responses stream: response.created, response.in_progress, the message item (output_item.added,
    content_part.added, one output_text.delta per delta, output_text.done, content_part.done,
    output_item.done), each function call (output_item.added, function_call_arguments.delta / .done,
    output_item.done), then response.completed (or response.incomplete), each with its sequence_number.

    start: the Response in progress. deltas: the message's text as the client is shown it, as it is
    sampled. finish(): the final Response, once deltas end; its message item is `message_id`."""
    seq = 0

    def event(kind: str, **fields) -> dict:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **fields}

    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    at = {"item_id": message_id, "output_index": 0}
    opened, streamed = False, []

    def open_message() -> list[dict]:
        item = {"id": message_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        return [event("response.output_item.added", output_index=0, item=item),
                event("response.content_part.added", **at, content_index=0,
                      part={"type": "output_text", "text": "", "annotations": []})]

    async for delta in deltas:
        if not delta:
            continue
        if not opened:
            for e in open_message():
                yield e
            opened = True
        streamed.append(delta)
        yield event("response.output_text.delta", **at, content_index=0, delta=delta, logprobs=[])
    final = _with_streamed(await finish(), message_id, streamed if opened else None)
    for index, item in enumerate(final["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            if not opened:
                for e in open_message():
                    yield e
                if part["text"]:
                    yield event("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **at, content_index=0, text=part["text"],
                        logprobs=part.get("logprobs", []))
            yield event("response.content_part.done", **at, content_index=0, part=part)
        else:  # a function call
            call = {"item_id": item["id"], "output_index": index}
            yield event("response.output_item.added", output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"})
            yield event("response.function_call_arguments.delta", **call, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **call, name=item["name"],
                        arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield event(kind, response=final)
