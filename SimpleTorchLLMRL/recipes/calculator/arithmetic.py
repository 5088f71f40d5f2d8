"""Synthetic arithmetic with a calculator tool: the task the embedded tiny model knows.

Two-operand problems over 2-3 digit numbers ("What is 47 * 23?"), answered directly (`\\boxed{1081}`) or
through a `<tool_call>` to the calculator. A stable hash of the expression puts every problem in one split.

    rows = build_dataset(200, seed=0, split="train")   # [{"question": ..., "answer": ...}]
    check_answer("\\boxed{1081}", "1081")             # True
    safe_eval("47 * 23")                               # 1081
"""

from __future__ import annotations

import json
import random
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.reward.math import extract_boxed
from SimpleTorchLLMRL.tools.base import CalculatorError, evaluate, format_number
from SimpleTorchLLMRL.tools.parsers import JsonToolCallParser, format_json_call

OPS = ("+", "-", "*")
SPLITS = ("train", "test")
HELDOUT_MOD = 5  # one problem in HELDOUT_MOD is held out (by hash)
QUESTION_TEMPLATES = ("What is {expr}?", "Compute {expr}.", "Calculate {expr}.")

SYSTEM_PROMPT = (
    "Solve the arithmetic problem. You may call the calculator tool. "
    "Give the final answer as \\boxed{number}."
)

# The schema of `SimpleTorchLLMRL.tools.calculator` (tests keep the two equal): what the chat
# template shows the model under "# Tools" when an env passes `tools=`.
CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string",
                               "description": 'The arithmetic expression, for example "3 * (4 + 5) / 2".'}
            },
            "required": ["expression"],
        },
        "return": {"type": "string"},
    },
}

_CALLS = JsonToolCallParser(allow_unclosed=False)


@dataclass(frozen=True)
class Problem:
    """One problem: `a op b`, its question text and integer answer."""

    a: int
    op: str
    b: int
    template: int = 0

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"Problem op must be one of {OPS}, got {self.op!r}")
        if not 0 <= self.template < len(QUESTION_TEMPLATES):
            raise ValueError(f"Problem template must be in [0, {len(QUESTION_TEMPLATES)}), got {self.template}")

    @property
    def expression(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def question(self) -> str:
        return QUESTION_TEMPLATES[self.template].format(expr=self.expression)

    @property
    def answer(self) -> int:
        return safe_eval(self.expression)

    @property
    def split(self) -> str:
        return split_of(self.expression)

    def to_row(self) -> dict:
        return {"question": self.question, "answer": str(self.answer)}


def split_of(expression: str) -> str:
    """"test" for one expression in HELDOUT_MOD (stable crc32 hash), "train" otherwise."""
    canonical = " ".join(expression.split())
    return "test" if zlib.crc32(canonical.encode()) % HELDOUT_MOD == 0 else "train"


def random_problem(rng: random.Random, ops: tuple[str, ...] = OPS, min_digits: int = 2,
                   max_digits: int = 3) -> Problem:
    """A uniformly drawn op, operand digit counts in [min_digits, max_digits], any split."""
    def operand() -> int:
        d = rng.randint(min_digits, max_digits)
        return rng.randint(10 ** (d - 1), 10**d - 1)

    return Problem(operand(), rng.choice(ops), operand(), rng.randrange(len(QUESTION_TEMPLATES)))


def iter_problems(seed: int, split: str = "train", ops: tuple[str, ...] = OPS, unique: bool = True,
                  min_digits: int = 2, max_digits: int = 3) -> Iterator[Problem]:
    """An endless, seeded stream of problems of one split (no repeated expression when `unique`)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    bad = [o for o in ops if o not in OPS]
    if not ops or bad:
        raise ValueError(f"ops must be a non-empty subset of {OPS}, got {ops!r}")
    if not 1 <= min_digits <= max_digits <= 6:
        raise ValueError(f"need 1 <= min_digits <= max_digits <= 6, got {min_digits}, {max_digits}")
    rng = random.Random(seed)
    seen: set[str] = set()
    while True:
        p = random_problem(rng, ops, min_digits, max_digits)
        if p.split != split or (unique and p.expression in seen):
            continue
        if unique:
            seen.add(p.expression)
        yield p


def generate_problems(n: int, seed: int = 0, split: str = "train", **kwargs) -> list[Problem]:
    """The first `n` problems of `iter_problems(seed, split, ...)`."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    it = iter_problems(seed, split, **kwargs)
    return [next(it) for _ in range(n)]


def build_dataset(n: int, seed: int = 0, split: str = "train", **kwargs) -> list[dict]:
    """Rows {"question": str, "answer": str} ready for jsonl (see `write_jsonl`)."""
    return [p.to_row() for p in generate_problems(n, seed, split, **kwargs)]


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    """One JSON object per line; returns the path."""
    path = Path(path)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


MAX_EXPRESSION_CHARS = 200
MAX_ABS = 10**15  # the task's answers stay far below this
_OPERATORS = frozenset("+-*() 0123456789")


def safe_eval(expression: str) -> int:
    """The task's integer + - * ( ) arithmetic, evaluated by the library's calculator; ValueError otherwise."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression must be a string of at most {MAX_EXPRESSION_CHARS} characters")
    if not set(expression) <= _OPERATORS or "**" in expression.replace(" ", ""):
        raise ValueError(f"unsupported element in expression {expression!r}: only integers, + - * and ( )")
    value = evaluate(expression)
    if not isinstance(value, int):
        raise ValueError(f"expression {expression!r} is not integer arithmetic")
    if abs(value) > MAX_ABS:
        raise ValueError("expression result is too large")
    return value


def parse_int(text: str | None) -> int | None:
    """"1,081" / " -24 " / "1081.0" -> int; None when it is not an integer."""
    if text is None:
        return None
    s = text.replace(",", "").replace(" ", "")
    if re.fullmatch(r"[+-]?\d+", s):
        return int(s)
    if re.fullmatch(r"[+-]?\d+\.0*", s):
        return int(s.split(".")[0])
    return None


def check_answer(text: str, answer: str | int) -> bool:
    """True when the last `\\boxed{}` in `text` is the integer `answer`."""
    got = parse_int(extract_boxed(text))
    want = parse_int(str(answer))
    return got is not None and got == want


def format_tool_call(expression: str) -> str:
    """The assistant text of a calculator call (Hermes/Qwen style)."""
    return format_json_call("calculator", {"expression": expression})


def parse_tool_call(text: str) -> str | None:
    """The calculator expression of the first well-formed `<tool_call>`, or None."""
    calls = _CALLS.parse(text or "")
    expression = (calls[0].arguments or {}).get("expression") if calls else None
    ok = calls and calls[0].error is None and calls[0].name == "calculator" and isinstance(expression, str)
    return expression if ok else None


def run_calculator(expression: str) -> str:
    """The TOOL message text for an expression: what the calculator tool answers, or an error sentence."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as e:
        return f"Error: {e}"


def format_answer(value: int | str) -> str:
    return f"\\boxed{{{value}}}"


def prompt_messages(question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[Message]:
    """Opening messages: optional system prompt, then the question."""
    msgs = [Message(system_prompt, MessageType.SYSTEM)] if system_prompt else []
    return msgs + [Message(question, MessageType.MESSAGE)]


def solution_rollout(question: str, *, use_tool: bool, final_answer: int | str | None = None,
                     expression: str | None = None, system_prompt: str | None = SYSTEM_PROMPT,
                     tools: list[dict] | None = None) -> Rollout:
    """A worked rollout for supervised warm-up. use_tool=True: the assistant calls the calculator on
    `expression` and boxes the TOOL message's result; False: it boxes `final_answer` directly (wrong on
    purpose, maybe: the warm-up teaches the format). `tools` lands in `metadata["tools"]` for the template.
    """
    msgs = prompt_messages(question, system_prompt)
    if use_tool:
        if expression is None:
            raise ValueError("solution_rollout(use_tool=True) needs expression=")
        result = run_calculator(expression)
        msgs += [
            Message(format_tool_call(expression), MessageType.MODEL),
            Message(result, MessageType.TOOL, name="calculator"),
            Message(format_answer(result), MessageType.MODEL),
        ]
    else:
        if final_answer is None:
            raise ValueError("solution_rollout(use_tool=False) needs final_answer=")
        msgs.append(Message(format_answer(final_answer), MessageType.MODEL))
    metadata = {"tools": tools} if tools else {}
    return Rollout(msgs, metadata)


def used_tool(rollout: Rollout) -> bool:
    """True when some MODEL turn of the rollout holds a well-formed calculator call."""
    return any(parse_tool_call(m.content) is not None for m in rollout if m.type is MessageType.MODEL)


def rollout_correct(rollout: Rollout, answer: int | str | None = None) -> bool:
    """`check_answer` on the last MODEL turn; `answer` defaults to `rollout.metadata["answer"]`."""
    last = rollout.last(MessageType.MODEL)
    want = rollout.metadata.get("answer") if answer is None else answer
    return last is not None and want is not None and check_answer(last.content, want)
