"""What a JSON schema may hold before the gateway turns it into a grammar, checked in one pass of Python
before anything is compiled: keywords the grammar enforces (or annotations), bounded sizes per request, local
`$ref`s that resolve, a finite instance for every subschema (docs/gateway.md, "Structured output").

    budget = Budget()
    check_schema(schema, "response_format", budget)     # raises RequestError (400) naming the field
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from SimpleTorchLLMRL.gateway.request import bad

MAX_NODES = 2000  # subschemas in one request
MAX_ENUM_VALUES = 1000  # enum and const values in one request (OpenAI's structured-output limit)
MAX_ENUM_CHARS = 15_000  # characters of those values' JSON text in one request
MAX_REPEAT = 1000  # the largest count a pattern's {m,n} may name, and their sum over a request
MAX_BOUND = 10_000  # minLength / maxLength / minItems / maxItems / minProperties / maxProperties
# keywords whose value is a schema, a list of schemas, or a map of name -> schema
ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "contains", "propertyNames")
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
NAMED = ("properties", "patternProperties", "$defs", "definitions")
BOUNDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
          "maxContains")
ENFORCED = frozenset({*ONE, *MANY, *NAMED, *BOUNDS, "type", "required", "enum", "const", "$ref", "minimum", "maximum",
                      "exclusiveMinimum", "exclusiveMaximum", "pattern", "format", "multipleOf", "nullable"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "discriminator", "$anchor", "contentEncoding",
                         "contentMediaType"})
FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


@dataclass
class Budget:
    """What one request's schemas have used of the bounds above."""

    nodes: int = 0
    enum_values: int = 0
    enum_chars: int = 0
    repeats: int = 0


def check_schema(schema: Any, field: str, budget: Budget) -> None:
    """Raise a 400 naming `field` when `schema` holds what the grammar cannot enforce, passes a bound, or
    has a subschema without a finite instance (module docstring)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad(f"{field}: a JSON schema must be an object or a boolean, got {type(schema).__name__}", field,
                  "invalid_schema")
    nodes = _walk(schema, field, budget)
    _check_finite(schema, nodes, field)


def _walk(root: dict, field: str, budget: Budget) -> list[tuple[dict, str]]:
    """Every subschema (dict) of `root` with its path, each checked; the budget counted."""
    out, stack = [], [(root, "#")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise bad(f"{field}: the schema at {path} must be an object or a boolean", field, "invalid_schema")
        budget.nodes += 1
        if budget.nodes > MAX_NODES:
            raise bad(f"{field}: the schemas hold more than {MAX_NODES} subschemas", field, "schema_too_large")
        _check_node(node, path, field, budget)
        out.append((node, path))
        stack.extend(_children(node, path, field))
    return out


def _children(node: dict, path: str, field: str) -> list[tuple[Any, str]]:
    out = []
    for key in ONE:
        if key in node:
            value = node[key]
            items = value if key == "items" and isinstance(value, list) else [value]
            out.extend((v, f"{path}/{key}") for v in items)
    for key in MANY:
        if key in node:
            if not isinstance(node[key], list) or not node[key]:
                raise bad(f"{field}: '{key}' at {path} must be a non-empty list of schemas", field, "invalid_schema")
            out.extend((v, f"{path}/{key}/{i}") for i, v in enumerate(node[key]))
    for key in NAMED:
        if key in node:
            if not isinstance(node[key], dict):
                raise bad(f"{field}: '{key}' at {path} must be an object of schemas", field, "invalid_schema")
            out.extend((v, f"{path}/{key}/{name}") for name, v in node[key].items())
    return out


def _check_node(node: dict, path: str, field: str, budget: Budget) -> None:
    """One subschema's keywords: enforced or annotations, within the bounds."""
    for key in node:
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise bad(f"{field}: the schema keyword '{key}' (at {path}) cannot be enforced by the grammar this "
                      f"gateway samples under; remove it or check it yourself", field, "unsupported_schema_keyword")
    if len(node.get("allOf") or []) > 1:
        raise bad(f"{field}: 'allOf' of several schemas (at {path}) cannot be enforced; merge them into one",
                  field, "unsupported_schema_keyword")
    if "oneOf" in node and not _disjoint(node["oneOf"]):
        raise bad(f"{field}: the 'oneOf' branches at {path} may overlap, so 'exactly one' cannot be enforced; use "
                  "'anyOf', or tell the branches apart by type or by a const / enum property they all require",
                  field, "unsupported_schema_keyword")
    if "multipleOf" in node and node.get("type") != "integer":
        raise bad(f"{field}: 'multipleOf' (at {path}) is enforced on integers only", field,
                  "unsupported_schema_keyword")
    if "format" in node and node["format"] not in FORMATS:
        raise bad(f"{field}: the format {node['format']!r:.40} (at {path}) cannot be enforced; known: "
                  f"{sorted(FORMATS)}", field, "unsupported_schema_keyword")
    for key in BOUNDS:
        value = node.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BOUND):
            raise bad(f"{field}: '{key}' (at {path}) must be an integer in [0, {MAX_BOUND}], got {value!r:.40}", field,
                      "schema_too_large")
    _count_values(node, path, field, budget)
    if "pattern" in node:
        _check_pattern(node["pattern"], path, field, budget)
    if "$ref" in node and not (isinstance(node["$ref"], str) and node["$ref"].startswith("#")):
        raise bad(f"{field}: only local $refs (\"#\", \"#/...\") are resolved; {node['$ref']!r:.80} (at {path}) is "
                  "not", field, "invalid_schema")


def _count_values(node: dict, path: str, field: str, budget: Budget) -> None:
    values = list(node["enum"]) if isinstance(node.get("enum"), list) else []
    if "enum" in node and not isinstance(node["enum"], list):
        raise bad(f"{field}: 'enum' (at {path}) must be a list", field, "invalid_schema")
    if "const" in node:
        values.append(node["const"])
    budget.enum_values += len(values)
    budget.enum_chars += sum(len(v) if isinstance(v, str) else len(repr(v)) for v in values)
    if budget.enum_values > MAX_ENUM_VALUES or budget.enum_chars > MAX_ENUM_CHARS:
        raise bad(f"{field}: the schemas' enum and const values pass {MAX_ENUM_VALUES} values or {MAX_ENUM_CHARS} "
                  f"characters (at {path})", field, "schema_too_large")


def _check_pattern(pattern: Any, path: str, field: str, budget: Budget) -> None:
    if not isinstance(pattern, str):
        raise bad(f"{field}: 'pattern' (at {path}) must be a string", field, "invalid_schema")
    for m in REPEAT.finditer(pattern):
        count = max(int(m.group(1)), int(m.group(2) or 0))
        budget.repeats += count
        if count > MAX_REPEAT or budget.repeats > MAX_REPEAT:
            raise bad(f"{field}: the pattern at {path} repeats up to {m.group(0)}; repetition counts may sum to at "
                      f"most {MAX_REPEAT} in a request", field, "schema_too_large")


def _types(node: dict) -> set[str] | None:
    """The JSON types a branch allows when it says (by `type`, `const` or `enum`), else None."""
    if "type" in node:
        kinds = node["type"] if isinstance(node["type"], list) else [node["type"]]
        return {"number" if k == "integer" else k for k in kinds if isinstance(k, str)}
    values = [node["const"]] if "const" in node else node.get("enum")
    if isinstance(values, list):
        return {type(v).__name__ for v in values}
    return None


def _tag_values(node: dict, prop: str) -> set | None:
    """The values a required property `prop` may take in a branch (its const / enum), else None."""
    if prop not in (node.get("required") or []):
        return None
    sub = (node.get("properties") or {}).get(prop)
    if not isinstance(sub, dict):
        return None
    values = [sub["const"]] if "const" in sub else sub.get("enum")
    return {repr(v) for v in values} if isinstance(values, list) else None


def _disjoint(branches: list) -> bool:
    """Whether no JSON value can match two `oneOf` branches: they allow disjoint types, or all require one
    property whose const / enum values are disjoint (a tagged union, as pydantic writes them)."""
    if not all(isinstance(b, dict) for b in branches):
        return False
    types = [_types(b) for b in branches]
    if all(t is not None for t in types) and sum(len(t) for t in types) == len(set().union(*types)):
        return True
    for prop in set(branches[0].get("required") or []):
        tags = [_tag_values(b, prop) for b in branches]
        if all(t is not None for t in tags) and sum(len(t) for t in tags) == len(set().union(*tags)):
            return True
    return False


# ----------------------------------------------------------------------------- finite instances


def _resolve(root: dict, ref: str, field: str) -> Any:
    node: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise bad(f"{field}: the $ref {ref!r:.80} does not resolve in its schema", field, "invalid_schema")
    return node


def _finite(node: Any, known: dict[int, bool], root: dict, field: str) -> bool:
    """Whether `node` has a finite instance, given what is `known` of the other subschemas (by id)."""
    if isinstance(node, bool):
        return node

    def ok(sub: Any) -> bool:  # known to have a finite instance
        return sub is True or (isinstance(sub, dict) and known.get(id(sub), False))

    if "$ref" in node and not ok(_resolve(root, node["$ref"], field)):
        return False
    branches = node.get("anyOf") or node.get("oneOf")
    if branches and not any(ok(b) for b in branches):
        return False
    least, prefix = node.get("minItems") or 0, node.get("prefixItems") or []
    needed = prefix[:least] + ([node["items"]] if least > len(prefix) and isinstance(node.get("items"), dict) else [])
    required = [(node.get("properties") or {}).get(name, True) for name in node.get("required") or []]
    return all(ok(b) for b in [*(node.get("allOf") or []), *required, *needed])


def _check_finite(root: dict, nodes: list[tuple[dict, str]], field: str) -> None:
    """The least fixpoint of `_finite` over the subschemas; one without a finite instance is a 400."""
    known: dict[int, bool] = {}
    changed = True
    while changed:
        changed = False
        for node, _ in nodes:
            if not known.get(id(node)) and _finite(node, known, root, field):
                known[id(node)] = changed = True
    stuck = [path for node, path in nodes if not known.get(id(node))]
    if stuck:
        raise bad(f"{field}: the schema at {stuck[0]} has no finite instance (a $ref loop with no base case, or a "
                  "required property that must contain itself): no reply could ever end", field, "invalid_schema")
