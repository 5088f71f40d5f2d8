"""response_format, tool_choice and parallel_tool_calls as one grammar for the reply (constrained decoding).

    spec = grammar_spec(response_format, tools, tool_choice, tool_function, parallel, parsers)  # checks only
    sampling = await compiler.sampling(spec, req.sampling)    # built and compiled off the loop, in a budget

`grammar_spec` checks while the request is parsed and builds nothing; `GrammarCompiler` builds (xgrammar's
EBNF) and compiles on its own threads within a budget, past which the request is a 400 naming the field. A
forced call is written as `JsonToolCallParser` reads it back. What each field asks for, and the caches:
docs/gateway.md, "Structured output" and "Bounds".
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from SimpleTorchLLMRL.gateway.request import bad
from SimpleTorchLLMRL.gateway.schemas import Budget, check_schema
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.tools.parsers import JsonToolCallParser

BUILT = 64  # built grammars kept (least recently used dropped)


@dataclass(frozen=True)
class GrammarSpec:
    """What a reply must match, checked but not built: `key` is the canonical JSON it is built from."""

    field: str  # the request field that asks for it (named by a 400)
    key: str


def response_format_schema(value) -> dict | bool | None:
    """The JSON schema a response_format asks for ({"type": "object"} for json_object), None for text."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                  f"{{\"type\": \"json_schema\", \"json_schema\": {{\"name\", \"schema\"}}}}; got {value!r:.200}",
                  "response_format", "invalid_value")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise bad("response_format json_schema needs \"json_schema\": {\"name\": ..., \"schema\": {...}}",
                  "response_format", "invalid_value")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, (dict, bool)):
        raise bad(f"response_format json_schema.schema must be a JSON schema object, got {schema!r:.200}",
                  "response_format", "invalid_value")
    return schema


def _json_parser(parsers: Sequence | None, field: str) -> JsonToolCallParser:
    """The gateway's `JsonToolCallParser` (the default when none is set); a 400 when there is none."""
    if parsers is None:
        return JsonToolCallParser()
    for p in parsers:
        if isinstance(p, JsonToolCallParser):
            return p
    names = ", ".join(type(p).__name__ for p in parsers) or "none"
    raise bad(f"{field} cannot be enforced with this gateway's tool-call format ({names}): a call is forced as "
              "<tool_call> JSON, which needs a JsonToolCallParser among the gateway's tool_parsers", field,
              "unsupported_value")


def grammar_spec(response_format, tools: list[dict] | None, tool_choice: str, tool_function: str | None,
                 parallel: bool, parsers: Sequence | None) -> GrammarSpec | None:
    """What every reply of the request must match, checked (a 400 naming the field it cannot enforce), None
    when nothing constrains it. tool_choice: "auto", "none", "required" or "function" (then `tool_function`
    names it); parallel: parallel_tool_calls (False: at most one call)."""
    schema = response_format_schema(response_format)
    forced = tool_choice in ("required", "function")
    if forced and schema is not None:
        raise bad(f"response_format {response_format.get('type')!r} and tool_choice {tool_choice!r} cannot both "
                  "hold: a forced tool call is not a JSON reply; use tool_choice 'auto'", "response_format",
                  "invalid_value")
    offered = tools if tool_choice != "none" else None
    budget = Budget()
    if schema is not None:
        check_schema(schema, "response_format", budget)
    if not (offered and (forced or not parallel or schema is not None)):
        return None if schema is None else GrammarSpec("response_format", json.dumps({"schema": schema}))
    field = "tool_choice" if forced else ("response_format" if schema is not None else "parallel_tool_calls")
    parser = _json_parser(parsers, field)
    chosen = [t for t in offered if t["function"]["name"] == tool_function] if tool_choice == "function" else offered
    params = [_parameters(t) for t in chosen]
    for p in params:
        check_schema(p, field, budget)
    key = {"schema": schema, "calls": [[t["function"]["name"], p] for t, p in zip(chosen, params, strict=True)],
           "forced": forced, "parallel": parallel, "tags": [parser.open_tag, parser.close_tag]}
    return GrammarSpec(field, json.dumps(key, sort_keys=True))


def _parameters(tool: dict):
    params = tool["function"].get("parameters")
    return {"type": "object", "properties": {}} if params is None else params


# ----------------------------------------------------------------------------- building (off the loop)


def _schema_grammar(schema, field: str) -> str:
    from SimpleTorchLLMRL.model.generation.constrain import json_schema_grammar

    try:
        return json_schema_grammar(schema)
    except ImportError as e:
        raise bad(f"{field} needs constrained decoding: {e}", field, "unsupported_parameter") from None
    except ValueError as e:
        raise bad(f"{field}: this schema cannot be enforced: {e}", field, "invalid_value") from None


def _tag(name: str, params, tags: list[str], field: str) -> dict:
    """A structural-tag `tag` of one call: its opening up to the arguments, their grammar, its end."""
    return {"type": "tag", "begin": f'{tags[0]}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
            "content": {"type": "grammar", "grammar": _schema_grammar(params, field)}, "end": f"}}\n{tags[1]}"}


def _structural(fmt: dict) -> str:
    import xgrammar as xgr

    return str(xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": fmt}))


@functools.lru_cache(maxsize=BUILT)
def build_grammar(field: str, key: str) -> str:
    """The EBNF of a `GrammarSpec` (its field and key): xgrammar's conversion, the slow part (cached)."""
    spec = json.loads(key)
    schema = spec["schema"]
    if "calls" not in spec:
        return _schema_grammar(schema, field)
    tags = [_tag(name, params, spec["tags"], field) for name, params in spec["calls"]]
    stop_after_first = not spec["parallel"]
    only_calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                  "stop_after_first": stop_after_first}
    if spec["forced"]:
        return _structural(only_calls)
    # "auto": any text, then calls (at most one when not parallel); with a JSON response_format: JSON or calls
    if schema is None:
        return _structural({"type": "triggered_tags", "triggers": [spec["tags"][0]], "tags": tags,
                            "stop_after_first": stop_after_first})
    json_reply = {"type": "grammar", "grammar": _schema_grammar(schema, field)}
    return _structural({"type": "or", "elements": [json_reply, only_calls]})


class GrammarCompiler:
    """Builds request grammars and compiles them for the backend (`prepare(ebnf)`, e.g. the HF backend's
    `prepare_grammar`) on `workers` threads of its own, each request within `budget` seconds."""

    def __init__(self, prepare: Callable[[str], None], budget: float, workers: int = 2):
        if not budget > 0:
            raise ValueError(f"the grammar compile budget must be a positive number of seconds, got {budget!r}")
        self.prepare, self.budget = prepare, budget
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar")

    def _compile(self, spec: GrammarSpec, sampling: SamplingConfig) -> SamplingConfig:
        ebnf = build_grammar(spec.field, spec.key)
        try:
            self.prepare(ebnf)
            return dataclasses.replace(sampling, grammar=ebnf)
        except ValueError as e:
            raise bad(f"{spec.field}: {e}", spec.field, "invalid_value") from e

    async def sampling(self, spec: GrammarSpec, sampling: SamplingConfig) -> SamplingConfig:
        """`sampling` with the spec's grammar, built and compiled; a 400 naming the field past the budget."""
        work = asyncio.get_running_loop().run_in_executor(self.pool, self._compile, spec, sampling)
        try:
            return await asyncio.wait_for(work, self.budget)
        except TimeoutError:
            raise bad(f"{spec.field}: its grammar did not compile within {self.budget:g} s; simplify the schema "
                      "or the tools", spec.field, "grammar_too_complex") from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
