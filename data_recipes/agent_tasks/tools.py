"""The calculator tool, and where the shipped documents the search tool reads live.

search, write_file and run_python are posttrain.envs.tools' sandboxed tools, so SFT demonstrations
and RL episodes run the very same code. The calculator is registered here, as a plug-in tool: it
parses the expression (no eval) and computes exactly with fractions on the host, like search it
executes no agent code.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from pathlib import Path

from posttrain.envs.sandbox import Sandbox
from posttrain.envs.tools import TOOLS, Tool

DOCS_DIR = Path(__file__).resolve().parents[1] / "docs"
MAX_EXPONENT = 64

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def calculate(expression: str) -> str:
    """Exact rational arithmetic: + - * / // % ** and parentheses on integers and decimals.
    Whole results print as integers, others with 6 significant digits."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"cannot parse {expression!r}: {error.msg}") from None
    value = _evaluate(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6g}"


def _evaluate(node: ast.AST) -> Fraction:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise ValueError(f"exponent must be a whole number of at most {MAX_EXPONENT}")
        return Fraction(_OPERATORS[type(node.op)](left, right))
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


@TOOLS.register("calculator")
class Calculator(Tool):
    """Arithmetic on the host: the expression is parsed, never executed."""

    name = "calculator"
    description = "Evaluate arithmetic."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 3*(4+5)"}},
        "required": ["expression"],
    }

    def execute(self, sandbox: Sandbox | None, expression: str) -> str:
        return calculate(expression)
