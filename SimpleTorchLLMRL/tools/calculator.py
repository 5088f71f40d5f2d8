"""A safe arithmetic calculator: the expression's `ast` is walked, never `eval`ed.

Supported: int and float literals, parentheses, unary + and -, and the binary
operators + - * / // % **. Everything else (names, calls, attributes, strings,
comparisons, ^) is refused with a `CalculatorError` that says what was found.
Sizes are bounded so no expression can take long: the text length, the exponent
of **, and the size of every intermediate integer (`max_int_bits`).

    evaluate("3 * (4 + 5)")      # 27
    evaluate("2 ** 0.5")         # 1.4142135623730951
    calculator.run({"expression": "10 / 4"})   # '2.5'  (the Tool)
"""

from __future__ import annotations

import ast
import math
import operator

from SimpleTorchLLMRL.tools.base import tool

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
