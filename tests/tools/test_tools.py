"""Tool, @tool, ToolRegistry (bad input becomes TOOL messages) and the calculator."""

import ast
import operator
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.utils import get_json_schema

from SimpleTorchLLMRL.chat.message import Message, MessageType
from SimpleTorchLLMRL.tools import (
    CalculatorError,
    Tool,
    ToolRegistry,
    calculator,
    evaluate,
    format_json_call,
    tool,
)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


@tool(timeout=0.3)
def sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


@tool
def boom(message: str) -> str:
    """Always fails.

    Args:
        message: The error message.
    """
    raise RuntimeError(message)


@tool
def leave() -> str:
    """Calls sys.exit."""
    raise SystemExit(3)


def call(name, **arguments):
    return format_json_call(name, arguments)


# ---- Tool and @tool ------------------------------------------------------------------------------------


def test_tool_schema_is_transformers_schema_and_call_passes_through():
    t = tool(add)
    assert isinstance(t, Tool) and t.name == "add"
    assert t.schema == get_json_schema(add)
    assert t.parameters["required"] == ["a"]
    assert t(2, 3) == 5 and t.run({"a": 2, "b": 3}) == "5"
    assert t.__doc__ == add.__doc__


def test_tool_overrides_and_text_argument():
    t = Tool(add, name="plus", description="Adds.", timeout=2)
    assert (t.name, t.description, t.timeout) == ("plus", "Adds.", 2)
    assert calculator.text_argument == "expression" and t.text_argument is None
    assert t.schema["function"]["name"] == "plus" and get_json_schema(add)["function"]["name"] == "add"


def test_tool_rejects_untyped_or_undocumented_functions():
    def untyped(x):
        """Doc.

        Args:
            x: thing
        """

    with pytest.raises(ValueError, match="type hints"):
        tool(untyped)
    with pytest.raises(ValueError, match="timeout"):
        Tool(add, timeout=0)


def test_schemas_render_in_the_chat_template(chatml_tokenizer):
    reg = ToolRegistry([add, calculator])
    text = chatml_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=reg.schemas,
                                                tokenize=False)
    assert '"name": "add"' in text and '"name": "calculator"' in text and "<tools>" in text


# ---- ToolRegistry ----------------------------------------------------------------------------------------


def test_registry_duplicate_names_and_bad_config():
    reg = ToolRegistry([add])
    with pytest.raises(ValueError, match="already registered"):
        reg.register(Tool(add))
    assert "add" in reg and len(reg) == 1 and reg.names == ["add"] and reg["add"].name == "add"
    with pytest.raises(ValueError, match="formats"):
        ToolRegistry(formats=("yaml",))
    with pytest.raises(ValueError, match="max_calls"):
        ToolRegistry(max_calls=0)


def test_execute_returns_tool_messages_in_call_order():
    reg = ToolRegistry([add, calculator], formats=("json", "tags"))
    msgs = reg(call("add", a=2, b=40) + " <calculator>3 * (4 + 5)</calculator> " + call("calculator", expression="10/4"))
    assert [(m.type, m.name, m.content) for m in msgs] == [
        (MessageType.TOOL, "add", "42"), (MessageType.TOOL, "calculator", "27"), (MessageType.TOOL, "calculator", "2.5")]
    assert not any(m.is_trainable for m in msgs)


@pytest.mark.parametrize("text, name, fragment", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>', None, "malformed tool call JSON"),
    (call("nope", x=1), "nope", "unknown tool 'nope'; available tools: add, boom, leave"),
    (call("add", a="two"), "add", "argument 'a' must be of type integer, got string \"two\""),
    (call("add", a=True), "add", "argument 'a' must be of type integer, got boolean"),
    (call("add", b=1), "add", "missing required argument(s): a"),
    (call("add", a=1, c=2), "add", "unexpected argument(s): c (allowed: a, b)"),
    (call("boom", message="kaput"), "boom", "tool 'boom' raised RuntimeError: kaput"),
    (call("leave"), "leave", "tool 'leave' raised SystemExit: 3"),
    ("<add>1</add>", "add", "takes no text argument"),
])
def test_bad_calls_become_error_messages(text, name, fragment):
    reg = ToolRegistry([add, boom, leave], formats=("json", "tags"))
    (msg,) = reg(text)
    assert msg.type is MessageType.TOOL and msg.name == name
    assert msg.content.startswith("Error: ") and fragment in msg.content


def test_integral_float_is_accepted_for_integer():
    assert ToolRegistry([add])(call("add", a=2.0, b=3))[0].content == "5"


def test_calls_run_concurrently_and_timeouts_do_not_block():
    @tool
    def wait(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "done"

    reg = ToolRegistry([wait, sleepy], timeout=5)
    start = time.monotonic()
    msgs = reg(call("wait", seconds=0.6) + call("wait", seconds=0.6) + call("wait", seconds=0.6)
               + call("sleepy", seconds=30))
    elapsed = time.monotonic() - start
    assert [m.content for m in msgs[:3]] == ["done"] * 3
    assert msgs[3].content == "Error: tool 'sleepy' timed out after 0.3 s"
    assert elapsed < 1.5  # serial would be >= 1.8 s; the hung call is abandoned after 0.3 s
    assert threading.main_thread().is_alive()


def test_too_many_calls_and_long_output_are_bounded():
    @tool
    def shout(n: int) -> str:
        """Repeat a letter.

        Args:
            n: how many
        """
        return "a" * n

    reg = ToolRegistry([shout], max_calls=2, max_output_chars=10)
    msgs = reg(call("shout", n=3) + call("shout", n=25) + call("shout", n=1) + call("shout", n=1))
    assert msgs[0].content == "aaa"
    assert msgs[1].content == "a" * 10 + "\n[... 15 more characters truncated]"
    assert msgs[2].content.startswith("Error: too many tool calls") and "2 ignored" in msgs[2].content
    assert len(msgs) == 3


def test_parse_accepts_message_or_text_only():
    reg = ToolRegistry([add])
    assert reg.parse(Message(call("add", a=1), MessageType.MODEL))[0].arguments == {"a": 1}
    with pytest.raises(TypeError):
        reg.parse(3)


# ---- calculator ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("expr, value", [
    ("3 * (4 + 5)", 27), ("10 / 4", 2.5), ("7 // 2", 3), ("-7 % 3", 2), ("2 ** 10", 1024), ("2 ** -1", 0.5),
    ("-(-3)", 3), ("+4", 4), ("1.5e2 + 0.5", 150.5), ("(((1)))", 1), ("0x10", 16), ("1_000 * 3", 3000),
])
def test_calculator_values(expr, value):
    assert evaluate(expr) == value and type(evaluate(expr)) is type(value)


@pytest.mark.parametrize("result, text", [("10 / 2", "5"), ("0.1 + 0.2", "0.3"), ("2 ** 0.5", "1.41421356237"),
                                          ("10 ** 20", "100000000000000000000"), ("1 / 3", "0.333333333333")])
def test_calculator_tool_formats_numbers(result, text):
    assert calculator.run({"expression": result}) == text


@pytest.mark.parametrize("expr, fragment", [
    ("__import__('os').system('true')", "unsupported syntax: Call"),
    ("x + 1", "unsupported syntax: Name"),
    ("(1).real", "unsupported syntax: Attribute"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("1j * 2", "only numbers"),
    ("2 ^ 3", "write ** for powers"),
    ("1 < 2", "unsupported syntax: Compare"),
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("2 ** 100000", "exponent 100000 is too large"),
    ("99 ** 999", "too large (over 4096 bits)"),
    ("(2 ** 1000) * (2 ** 1000) * (2 ** 1000) * (2 ** 1000) * (2 ** 1000)", "too large"),
    ("10.0 ** 400", "too large"), ("1e308 * 10", "not a finite number"),
    ("(-8) ** 0.5", "complex"),
    ("", "empty"), ("1 +", "invalid expression"), ("1" * 600, "too long"),
])
def test_calculator_refuses(expr, fragment):
    with pytest.raises(CalculatorError) as info:
        evaluate(expr)
    assert fragment in str(info.value)


def test_calculator_deep_nesting_is_an_error_or_a_value_never_a_crash():
    assert evaluate("-" * 400 + "1") == 1
    with pytest.raises(CalculatorError):
        evaluate("(" * 240 + "1" + ")" * 240)


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "%": operator.mod}
ints = st.integers(-10**6, 10**6)


@st.composite
def int_expressions(draw, depth=3):
    if depth == 0 or draw(st.booleans()):
        n = draw(ints)
        return f"({n})" if n < 0 else str(n)
    op = draw(st.sampled_from(sorted(_OPS)))
    return f"({draw(int_expressions(depth=depth - 1))} {op} {draw(int_expressions(depth=depth - 1))})"


@settings(max_examples=300, deadline=None)
@given(int_expressions())
def test_fuzz_calculator_matches_python_on_integer_arithmetic(expr):
    try:
        expected = eval(compile(ast.parse(expr, mode="eval"), "<test>", "eval"), {"__builtins__": {}})  # trusted
    except ZeroDivisionError:
        with pytest.raises(CalculatorError, match="division by zero"):
            evaluate(expr)
        return
    assert evaluate(expr) == expected


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/%().e ^xj_abc'", max_size=60))
def test_fuzz_calculator_only_returns_numbers_or_calculator_errors(expr):
    try:
        value = evaluate(expr)
    except CalculatorError:
        return
    assert isinstance(value, (int, float)) and not isinstance(value, bool)
