"""The calculator tool: numbers as a model expects them, errors as results."""

import pytest

from xrlhf.tools import build_tool, call_tool
from xrlhf.tools.calculator import format_number


@pytest.fixture
def calc():
    return build_tool("calculator")


@pytest.mark.parametrize("expression,expected", [
    ("1+2*3", "7"), ("(1+2)*3", "9"), ("6/3", "2"), ("7/2", "3.5"), ("7//2", "3"), ("-7//2", "-4"),
    ("7%3", "1"), ("2**10", "1024"), ("2**-2", "0.25"), ("-2**2", "-4"), ("-(3-5)", "2"), ("+4", "4"),
    ("0.1+0.2", "0.3"), ("1.5*4", "6"), (" 12 * 12 ", "144"), ("1_000+1", "1001"), ("2**0.5", "1.41421356237"),
])
def test_numbers(calc, expression, expected):
    result = call_tool(calc, expression)
    assert (result.output, result.error) == (expected, False)


@pytest.mark.parametrize("expression,message", [
    ("1/0", "division by zero"), ("5%0", "division by zero"), ("5//0", "division by zero"),
    ("0**-1", "division by zero"),
    ("x+1", "unsupported syntax"), ("abs(-1)", "unsupported syntax"), ("__import__('os')", "unsupported syntax"),
    ("'a'*3", "unsupported syntax"), ("True+1", "unsupported syntax"), ("3<4", "unsupported syntax"),
    ("1 if 1 else 2", "unsupported syntax"), ("(1).real", "unsupported syntax"), ("[1][0]", "unsupported syntax"),
    ("9**9**9", "result too large"), ("2**100000", "result too large"), ("1e308*10", "result too large"),
    ("10**999*10**999", "result too large"), ("1.5**100000", "result too large"), ("1e400", "result too large"),
    ("(-8)**(1/3)", "complex result"), ("", "invalid expression"), ("1+", "invalid expression"),
    ("(" * 400 + "1" + ")" * 400, "expression longer than 500 characters"),
])
def test_errors_are_results(calc, expression, message):
    result = call_tool(calc, expression)
    assert result.error and result.output == f"error: {message}"


def test_json_arguments_and_deep_nesting(calc):
    assert call_tool(calc, {"expression": "2*21"}).output == "42"
    bad = call_tool(calc, {"expr": "1"})
    assert bad.error and "takes one string argument 'expression'" in bad.output
    deep = build_tool("calculator", {"max_chars": 100_000})
    result = call_tool(deep, "-" * 50_000 + "1")
    assert result.error and result.output in ("error: expression too deep", "error: invalid expression")


def test_format_number():
    assert [format_number(v) for v in (2, 2.0, -3.0, 0.5, 1e20, 1 / 3)] == ["2", "2", "-3", "0.5", "1e+20",
                                                                             "0.333333333333"]
