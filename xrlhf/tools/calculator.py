"""The ``calculator`` tool: arithmetic a model can trust, evaluated without ``eval``.

The expression is parsed with :mod:`ast` and walked: numbers, ``+ - * / // % **``, unary signs
and parentheses, nothing else (no names, calls, attributes, comparisons). Every answer is bounded
in time by construction, so it runs in-process: exponents and results are capped (a model that
writes ``9**9**9`` gets ``error: result too large``, not a stalled rollout). Integer-valued
results print without ``.0`` (``6/3`` is ``2``); other floats with 12 significant digits.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from pydantic import Field

from xrlhf.tools.base import Sandbox, Tool, ToolOptions, ToolResult, register_tool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalcError(ValueError):
    """An expression the calculator refuses; the message is the tool's output."""


class CalculatorOptions(ToolOptions):
    """Options of the ``calculator`` tool."""

    max_digits: int = Field(1000, ge=16, le=4000, description="largest integer result, in decimal digits")
    max_chars: int = Field(500, ge=1, description="longest expression accepted")
    sandbox: Sandbox = Field("none", description="none: in the trainer's process (bounded by construction, about "
                             "25 us a call); a sandbox works too, at a pipe round trip a call")


@register_tool("calculator")
class Calculator(Tool):
    """Evaluates an arithmetic expression (see the module docstring for what is allowed)."""

    description = "evaluates an arithmetic expression with + - * / // % ** and parentheses, e.g. 2*(3+4)"
    argument = "expression"
    Config = CalculatorOptions

    def run(self, arguments: str | dict[str, Any]) -> ToolResult:
        """The value of the expression, or ``error: ...`` (division by zero, unsupported syntax,
        result too large, invalid expression)."""
        try:
            return ToolResult(format_number(self.evaluate(self.text_argument(arguments))))
        except CalcError as e:
            return ToolResult(f"error: {e}", error=True)

    def evaluate(self, expression: str) -> int | float:
        """The value of ``expression``.

        Raises:
            CalcError: for anything but bounded arithmetic on numbers.
        """
        expression = expression.strip()
        if len(expression) > self.config.max_chars:
            raise CalcError(f"expression longer than {self.config.max_chars} characters")
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError:
            raise CalcError("invalid expression") from None
        except ValueError:  # an integer literal beyond Python's digit limit
            raise CalcError("result too large") from None
        except (RecursionError, MemoryError):
            raise CalcError("expression too deep") from None
        try:
            return self._eval(tree.body)
        except RecursionError:
            raise CalcError("expression too deep") from None

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._checked(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            try:
                value = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalcError("division by zero") from None
            except OverflowError:
                raise CalcError("result too large") from None
            return self._checked(value)
        raise CalcError("unsupported syntax")

    def _max_bits(self) -> int:
        return int(self.config.max_digits * math.log2(10)) + 1

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        """Refuse a power before computing it if its result would be too large."""
        if isinstance(exponent, int) and isinstance(base, int) and abs(base) > 1 and exponent > 0:
            if exponent * (abs(base).bit_length() - 1) > self._max_bits():
                raise CalcError("result too large")
        elif abs(exponent) > 10_000 and abs(base) not in (0, 1):
            raise CalcError("result too large")

    def _checked(self, value: Any) -> int | float:
        if isinstance(value, complex):
            raise CalcError("complex result")
        if isinstance(value, int) and value.bit_length() > self._max_bits():
            raise CalcError("result too large")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalcError("result too large" if math.isinf(value) else "not a number")
        return value


def format_number(value: int | float) -> str:
    """``value`` as the calculator prints it: integers (and integer-valued floats below 1e15)
    without a decimal point, other floats with 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)
