"""response_format, tool_choice and parallel_tool_calls as one grammar for the reply (constrained decoding).

    reply_grammar(response_format, tools, tool_choice, tool_function, parallel, parsers) -> EBNF | None

The grammar goes into the call's `SamplingConfig.grammar`; the HF loops and vLLM enforce it
(`model/generation/constrain.py`). Every piece is built by xgrammar from a JSON schema, so a reply that matches
the grammar parses and validates:

    response_format json_object       one JSON object
    response_format json_schema       JSON of that schema (strict: no properties beyond it)
    tool_choice "required"            one or more calls of the offered tools, nothing else
    tool_choice {"function": {N}}     one or more calls of N (exactly one with parallel_tool_calls false)
    parallel_tool_calls false, "auto" any text, then at most one call

A call is written the way the gateway's tool parser reads it back (`reply_view`): the Hermes / Qwen
`<tool_call>\\n{"name": "N", "arguments": {...}}\\n</tool_call>` of `JsonToolCallParser`, with
that parser's tags, the name one of the offered tools and the arguments that tool's parameters
schema; several calls are separated by a newline. A parser whose format is not this one (tag or
code-block calls) cannot be forced: a FieldError naming the field. With tools and a JSON
response_format under "auto" the reply is either the JSON or tool calls.

No JSON whitespace is free (", " and ": " separators), so a small model cannot loop on spaces.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from SimpleTorchLLMRL.gateway.fields import FieldError
from SimpleTorchLLMRL.model.generation.constrain import json_schema_grammar
from SimpleTorchLLMRL.tools.parsers import JsonToolCallParser


def response_format_schema(value) -> dict | None:
    """The JSON schema a response_format asks for ({"type": "object"} for json_object), None for text."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise FieldError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         f"{{\"type\": \"json_schema\", \"json_schema\": {{\"name\", \"schema\"}}}}; got {value!r:.200}",
                         "response_format", "invalid_value")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise FieldError("response_format json_schema needs \"json_schema\": {\"name\": ..., \"schema\": {...}}",
                         "response_format", "invalid_value")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, (dict, bool)):
        raise FieldError(f"response_format json_schema.schema must be a JSON schema object, got {schema!r:.200}",
                         "response_format", "invalid_value")
    return schema


def _schema_grammar(schema, field: str, what: str) -> str:
    try:
        return json_schema_grammar(schema)
    except ImportError as e:
        raise FieldError(f"{field} needs constrained decoding: {e}", field, "unsupported_parameter") from None
    except ValueError as e:
        raise FieldError(f"{field}: {what} cannot be enforced: {e}", field, "invalid_value") from None


def _json_parser(parsers: Sequence | None, field: str) -> JsonToolCallParser:
    """The gateway's `JsonToolCallParser` (the default when none is set); a FieldError when there is none."""
    if parsers is None:
        return JsonToolCallParser()
    for p in parsers:
        if isinstance(p, JsonToolCallParser):
            return p
    names = ", ".join(type(p).__name__ for p in parsers) or "none"
    raise FieldError(f"{field} cannot be enforced with this gateway's tool-call format ({names}): a call is "
                     "forced as <tool_call> JSON, which needs a JsonToolCallParser among the gateway's "
                     "tool_parsers", field, "unsupported_value")


def _tag(parser: JsonToolCallParser, tool: dict, field: str) -> dict:
    """A structural-tag `tag` of one call of `tool`: its opening up to the arguments, their grammar, its end."""
    fn = tool["function"]
    params = fn.get("parameters")
    params = {"type": "object", "properties": {}} if params is None else params
    args = _schema_grammar(params, field, f"the parameters schema of tool {fn['name']!r}")
    return {"type": "tag", "begin": f'{parser.open_tag}\n{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, '
                                     '"arguments": ',
            "content": {"type": "grammar", "grammar": args}, "end": f"}}\n{parser.close_tag}"}


def _structural(fmt: dict) -> str:
    import xgrammar as xgr

    return str(xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": fmt}))


def reply_grammar(response_format, tools: list[dict] | None, tool_choice: str, tool_function: str | None,
                  parallel: bool, parsers: Sequence | None) -> str | None:
    """The EBNF every reply of the request must match, None when nothing constrains it.

    tool_choice: "auto", "none", "required" or "function" (then `tool_function` names it); parallel:
    parallel_tool_calls (False: at most one call). Raises FieldError naming the field it cannot enforce.
    """
    schema = response_format_schema(response_format)
    forced = tool_choice in ("required", "function")
    if forced and schema is not None:
        raise FieldError(f"response_format {response_format.get('type')!r} and tool_choice {tool_choice!r} "
                         "cannot both hold: a forced tool call is not a JSON reply; use tool_choice 'auto'",
                         "response_format", "invalid_value")
    offered = tools if tool_choice != "none" else None
    constrain_calls = offered and (forced or not parallel or schema is not None)
    if not constrain_calls:
        return None if schema is None else _schema_grammar(schema, "response_format", "this schema")
    field = "tool_choice" if forced else ("response_format" if schema is not None else "parallel_tool_calls")
    parser = _json_parser(parsers, field)
    chosen = [t for t in offered if t["function"]["name"] == tool_function] if tool_choice == "function" else offered
    tags = [_tag(parser, t, field) for t in chosen]
    if forced:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                 "stop_after_first": not parallel}
        return _structural(calls)
    # "auto": any text, then calls (at most one when not parallel); with a JSON response_format: JSON or calls
    calls = {"type": "triggered_tags", "triggers": [parser.open_tag], "tags": tags, "stop_after_first": not parallel}
    if schema is None:
        return _structural(calls)
    only_calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                  "stop_after_first": not parallel}
    json_reply = {"type": "grammar", "grammar": _schema_grammar(schema, "response_format", "this schema")}
    return _structural({"type": "or", "elements": [json_reply, only_calls]})
