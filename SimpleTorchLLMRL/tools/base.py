"""`Tool` and the `@tool` decorator: a typed function plus the JSON schema `apply_chat_template(tools=)` takes.

    @tool
    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        '''
        return a + b

    add.run({"a": 2, "b": 3})         # '5': checked arguments (ToolArgumentError for the model), result as text

`calculator`, the built-in tool, walks the expression's `ast` (never `eval`), with bounded sizes.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
from collections.abc import Callable
from typing import Any

_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


class ToolArgumentError(ValueError):
    """The arguments of a call do not fit the tool's schema (the message is for the model)."""


_NAMES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), ((list, tuple), "array"),
          (dict, "object"), (type(None), "null"))  # bool before int: True is an int too


def _type_name(value: Any) -> str:
    return next((name for kind, name in _NAMES if isinstance(value, kind)), type(value).__name__)


def _fits(value: Any, kind: str) -> bool:
    if kind not in _JSON_TYPES:
        return True  # a type this checker does not know: let the function decide
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False  # JSON true is not a number
    if kind == "number" and isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, _JSON_TYPES[kind])


def _types(spec: dict) -> list[str]:
    kinds = spec.get("type")
    return [kinds] if isinstance(kinds, str) else list(kinds or [])


def check_value(value: Any, spec: dict, where: str) -> Any:
    """Check `value` against a (small subset of) JSON schema `spec`; return it, coerced.

    Coercion is limited to what models commonly emit: an integral float (3.0) for
    an integer parameter. Raises ToolArgumentError naming `where`.
    """
    kinds = _types(spec)
    if spec.get("nullable") and value is None:
        return None
    if kinds:
        if "integer" in kinds and isinstance(value, float) and value.is_integer() and "number" not in kinds:
            value = int(value)
        if not any(_fits(value, k) for k in kinds):
            shown = json.dumps(value)[:60] if _type_name(value) in _JSON_TYPES else repr(value)[:60]
            raise ToolArgumentError(
                f"argument {where!r} must be of type {' or '.join(kinds)}, got {_type_name(value)} {shown}"
            )
    if "enum" in spec and value not in spec["enum"]:
        raise ToolArgumentError(f"argument {where!r} must be one of {spec['enum']}, got {value!r}")
    if isinstance(value, (list, tuple)) and isinstance(spec.get("items"), dict):
        value = [check_value(v, spec["items"], f"{where}[{i}]") for i, v in enumerate(value)]
    return value


class Tool:
    """A callable with an OpenAI-format JSON schema.

    fn:          a function with type hints and a Google-style docstring (`Args:` section)
    name:        overrides the function's name in the schema
    description: overrides the docstring's description
    timeout:     seconds a call may take (None: the registry's default)
    schema:      a ready schema; by default derived with `transformers.utils.get_json_schema`
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                 timeout: float | None = None, schema: dict | None = None):
        if not callable(fn):
            raise TypeError(f"Tool needs a callable, got {type(fn).__name__}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"Tool timeout must be a positive number of seconds or None, got {timeout!r}")
        if schema is None:
            from transformers.utils import get_json_schema

            try:
                schema = get_json_schema(fn)
            except Exception as e:  # TypeHintParsingException / DocstringParsingException
                raise ValueError(
                    f"cannot derive a tool schema from {getattr(fn, '__name__', fn)!r}: {e}. A tool function "
                    "needs type hints on every argument and a Google-style docstring with an Args: section."
                ) from e
        schema = json.loads(json.dumps(schema))  # an independent, JSON-clean copy
        if "function" not in schema or "name" not in schema["function"]:
            raise ValueError("Tool schema must look like {'type': 'function', 'function': {'name': ..., ...}}")
        if name is not None:
            schema["function"]["name"] = name
        if description is not None:
            schema["function"]["description"] = description
        self.fn = fn
        self.schema = schema
        self.timeout = timeout
        functools.update_wrapper(self, fn, updated=())

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def description(self) -> str:
        return self.schema["function"].get("description", "")

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}

    @property
    def text_argument(self) -> str | None:
        """The parameter a bare text body (`<tag>body</tag>`, a code block) is bound to.

        The only string parameter, else the first required string parameter; None if there is none.
        """
        props = self.parameters.get("properties", {})
        strings = [k for k, v in props.items() if "string" in _types(v)]
        if len(strings) == 1:
            return strings[0]
        required = [k for k in self.parameters.get("required", []) if k in strings]
        return required[0] if required else None

    def check_arguments(self, arguments: Any) -> dict:
        """Arguments checked against the schema (missing, unexpected, types); raises ToolArgumentError."""
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"arguments must be a JSON object, got {_type_name(arguments)}")
        props = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            raise ToolArgumentError(f"missing required argument(s): {', '.join(missing)}")
        unknown = [k for k in arguments if k not in props]
        if unknown:
            allowed = ", ".join(props) or "none"
            raise ToolArgumentError(f"unexpected argument(s): {', '.join(map(str, unknown))} (allowed: {allowed})")
        return {k: check_value(v, props[k], k) for k, v in arguments.items()}

    def bind_text(self, text: str) -> dict:
        """Arguments for a bare text body; raises ToolArgumentError if the tool takes no text."""
        arg = self.text_argument
        if arg is None:
            raise ToolArgumentError(f"tool {self.name!r} takes no text argument; call it with JSON arguments")
        return {arg: text}

    def run(self, arguments: dict) -> str:
        """Check `arguments`, call the function, and return its result as text."""
        result = self.fn(**self.check_arguments(arguments))
        return format_result(result)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


def format_result(result: Any) -> str:
    """A tool's return value as message text: strings as they are, the rest as JSON (or str)."""
    if isinstance(result, str):
        return result
    if hasattr(result, "to_text"):
        return result.to_text()
    try:
        return json.dumps(result, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(result)


def tool(fn: Callable | None = None, *, name: str | None = None, description: str | None = None,
         timeout: float | None = None):
    """Decorator: `@tool` or `@tool(name=..., timeout=...)` turns a function into a `Tool`."""
    def wrap(f: Callable) -> Tool:
        return Tool(f, name=name, description=description, timeout=timeout)

    return wrap(fn) if fn is not None else wrap


# ---------------------------------------------------------------- the calculator tool

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_INT_BITS = 4096


class CalculatorError(ValueError):
    """The expression cannot be evaluated (the message is meant for the model)."""


_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _check_size(value: int | float, max_int_bits: int) -> int | float:
    if isinstance(value, complex):
        raise CalculatorError("the result is a complex number")
    if isinstance(value, int) and value.bit_length() > max_int_bits:
        raise CalculatorError(f"a number is too large (over {max_int_bits} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number (overflow)")
    return value


def _power(base: int | float, exp: int | float, max_exponent: int, max_int_bits: int) -> int | float:
    if abs(exp) > max_exponent:
        raise CalculatorError(f"the exponent {exp} is too large (limit {max_exponent})")
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
        if exp * math.log2(abs(base)) > max_int_bits:  # decide before computing
            raise CalculatorError(f"the result of {base} ** {exp} is too large (over {max_int_bits} bits)")
    if base == 0 and exp < 0:
        raise CalculatorError("division by zero (0 raised to a negative power)")
    return base ** exp


def _eval(node: ast.AST, max_exponent: int, max_int_bits: int) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body, max_exponent, max_int_bits)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, found {node.value!r}")
        return _check_size(node.value, max_int_bits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, max_exponent, max_int_bits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _eval(node.left, max_exponent, max_int_bits)
        right = _eval(node.right, max_exponent, max_int_bits)
        try:
            if isinstance(node.op, ast.Pow):
                value = _power(left, right, max_exponent, max_int_bits)
            else:
                value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large (overflow)") from None
        return _check_size(value, max_int_bits)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculatorError("'^' is not a power operator here; write ** for powers")
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}; use numbers, parentheses and + - * / // % **")


def evaluate(expression: str, *, max_exponent: int = MAX_EXPONENT, max_int_bits: int = MAX_INT_BITS,
             max_chars: int = MAX_EXPRESSION_CHARS) -> int | float:
    """The value of an arithmetic expression; raises CalculatorError for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    expression = expression.strip()
    if not expression:
        raise CalculatorError("the expression is empty")
    if len(expression) > max_chars:
        raise CalculatorError(f"the expression is too long ({len(expression)} characters, limit {max_chars})")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalculatorError(f"invalid expression: {getattr(e, 'msg', e)}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("the expression is nested too deeply") from None
    try:
        return _eval(tree, max_exponent, max_int_bits)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_number(value: int | float) -> str:
    """Ints as they are; floats with 12 significant digits, integral ones without '.0'."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}"


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: The arithmetic expression, for example "3 * (4 + 5) / 2".
    """
    return format_number(evaluate(expression))
