"""Which Chat Completions request fields the gateway honours, accepts without effect, or refuses.

The rule: every field of a request is honoured, or refused with an OpenAI-shaped 400 whose `param`
names it; none is silently ignored. A field that would change the reply and is not implemented is
refused whenever it is set to anything but its default (null, or the value OpenAI treats as unset);
a field nobody knows is refused as OpenAI refuses it ("Unrecognized request argument").

    check_fields(body)               raises FieldError for an unknown or refused field
    tool_choice_of(body, tools)      -> "auto" | "none" | "required" | "function" (raises FieldError)
    tool_function_of(body)           the function a named tool_choice forces, else None
    parallel_of(body)                parallel_tool_calls as a bool (default True)

response_format, tool_choice "required" / a named function and parallel_tool_calls false are
enforced by a grammar of the reply (`gateway.structured`).

docs/gateway.md carries the same table for users.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# read by `parse_request` and applied to the reply (return_token_ids, chat_template_kwargs: the gateway's own)
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
REFUSED_UNLESS_DEFAULT: dict[str, tuple[Callable[[Any], bool], str]] = {
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


class FieldError(ValueError):
    """A refused field: `parse_request` answers it as a 400 with this param and code."""

    def __init__(self, message: str, param: str, code: str):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


_bad = FieldError


def check_fields(body: dict) -> None:
    """Refuse (400 naming the field) an unknown field, or a refused one set to a non-default value."""
    for key, value in body.items():
        if key in HONOURED:
            continue
        if key in NO_EFFECT:
            if key == "service_tier" and value not in SERVICE_TIERS:
                raise _bad(f"service_tier {value!r} is not supported; use 'auto' or 'default' (it has no effect "
                           "on sampling here)", key, "unsupported_value")
            if key == "metadata" and value is not None and not isinstance(value, dict):
                raise _bad("'metadata' must be an object of string keys and values", key, "invalid_type")
            continue
        rule = REFUSED_UNLESS_DEFAULT.get(key)
        if rule is None:
            raise _bad(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")
        is_default, why = rule
        if not is_default(value):
            raise _bad(f"{why} (got {key}={value!r})", key, "unsupported_parameter")


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
            raise _bad("tool_choice 'required' needs 'tools' to call", "tool_choice", "invalid_value")
        return "required"
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = tool_function_of(body)
        if name not in offered:
            raise _bad(f"tool_choice names the function {name!r}, which is not among the request's tools "
                       f"{offered}", "tool_choice", "invalid_value")
        return "function"
    raise _bad(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
               f"{{\"name\": ...}}}}; got {choice!r}", "tool_choice", "invalid_value")


def tool_function_of(body: dict) -> str | None:
    """The function name of a tool_choice {"type": "function", "function": {"name": N}}, else None."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice {\"type\": \"function\"} needs function.name", "tool_choice", "invalid_value")
    return name


def parallel_of(body: dict) -> bool:
    """parallel_tool_calls: True (left out or null) lets a reply carry several calls; False at most one."""
    value = body.get("parallel_tool_calls")
    if value is None:
        return True
    if not isinstance(value, bool):
        raise _bad(f"parallel_tool_calls must be true or false, got {value!r}", "parallel_tool_calls", "invalid_type")
    return value
