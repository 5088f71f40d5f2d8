"""Router-R1's tag grammar: read a MODEL turn's action (its first closed <search> or <answer>, as in the
original `postprocess_predictions`) and check a trajectory's format (docs/recipes.md, "Router-R1").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from SimpleTorchLLMRL.tools.parsers import TagToolCallParser

MODEL_TAGS = ("think", "search", "answer")
ENV_TAGS = ("information",)
_ACTIONS = TagToolCallParser(["search", "answer"])
_ANY_TAG = re.compile(r"</?(think|search|answer|information)>")
_PLACEHOLDERS = ("model_name", "llm-name", "your-query", "your question")


@dataclass
class Action:
    """What a MODEL turn asks for. kind: "answer", "route" (a well-formed search, with `name` and `query`),
    "malformed_route" (a search that is not `NAME: query`), or "none" (neither tag closed)."""

    kind: str
    content: str = ""
    name: str | None = None
    query: str | None = None


def parse_route(content: str) -> tuple[str, str] | None:
    """`MODEL_NAME: query` -> (name, query); None when either part is missing or a placeholder."""
    name, sep, query = content.partition(":")
    name, query = name.strip(), query.strip()
    if not sep or not name or not query or any(p in content.lower() for p in _PLACEHOLDERS):
        return None
    return name, query


def parse_action(text: str) -> Action:
    """The first closed <search> / <answer> of a MODEL turn (see `Action`)."""
    calls = _ACTIONS.parse(text)
    if not calls:
        return Action("none")
    call = calls[0]
    if call.name == "answer":
        return Action("answer", call.text or "")
    route = parse_route(call.text or "")
    if route is None:
        return Action("malformed_route", call.text or "")
    return Action("route", call.text or "", route[0], route[1])


def searches(text: str) -> list[tuple[str, str] | None]:
    """Every closed <search> of a turn, in order: (name, query), or None for a malformed one."""
    return [parse_route(c.text or "") for c in _ACTIONS.parse(text) if c.name == "search"]


def final_answer(model_texts: list[str]) -> str | None:
    """The content of the last closed <answer> in the MODEL turns (stripped), None when there is none."""
    for text in reversed(model_texts):
        calls = [c for c in _ACTIONS.parse(text) if c.name == "answer"]
        if calls:
            return calls[-1].text or ""
    return None


def format_problems(model_texts: list[str], require_think: bool = True) -> list[str]:
    """Why the MODEL turns are malformed (empty list: well formed): tags unbalanced or nested, <information>
    written by the model, a search not `NAME: query`, more than one <answer> or one not ending the last
    turn, and with require_think a first turn that does not open with a non-empty <think>."""
    problems = []
    for k, text in enumerate(model_texts):
        for tag in MODEL_TAGS:
            if text.count(f"<{tag}>") != text.count(f"</{tag}>"):
                problems.append(f"turn {k}: unbalanced <{tag}>")
        if any(f"<{t}>" in text or f"</{t}>" in text for t in ENV_TAGS):
            problems.append(f"turn {k}: the model wrote <information> itself")
        if _nested(text):
            problems.append(f"turn {k}: nested tags")
        if any(route is None for route in searches(text)):
            problems.append(f"turn {k}: search is not 'MODEL_NAME: query'")
    answers = sum(t.count("<answer>") for t in model_texts)
    if answers > 1:
        problems.append(f"{answers} <answer> blocks")
    if answers == 1 and not (model_texts[-1].rstrip().endswith("</answer>") and "<answer>" in model_texts[-1]):
        problems.append("the answer does not end the last turn")
    if require_think and model_texts:
        m = re.match(r"\s*<think>(.*?)</think>", model_texts[0], re.DOTALL)
        if m is None or not m.group(1).strip() or m.group(1).strip() == "...":
            problems.append("the first turn does not open with a <think> block")
    return problems


def _nested(text: str) -> bool:
    """True when a tag opens or closes inside another open tag (or a close has no open)."""
    open_tag = None
    for m in _ANY_TAG.finditer(text):
        closing, name = m.group(0).startswith("</"), m.group(1)
        if not closing:
            if open_tag is not None:
                return True
            open_tag = name
        else:
            if open_tag != name:
                return True
            open_tag = None
    return False
