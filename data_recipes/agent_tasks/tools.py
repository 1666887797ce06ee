"""The tools the shipped task families offer, executed for real.

calculator: exact arithmetic on a parsed expression (no eval); search: keyword search over the
shipped documents in data_recipes/docs; write_file: a file in the episode's workspace; run_python:
a Python program in a fresh interpreter process with a timeout, its working directory the workspace.

Results are short, deterministic strings (no temp paths, no tracebacks whose layout varies between
Python versions) so regenerating the SFT data gives identical bytes.
"""

from __future__ import annotations

import ast
import operator
import re
import subprocess
import sys
from fractions import Fraction
from functools import cache
from pathlib import Path
from typing import Any

DOCS_DIR = Path(__file__).resolve().parents[1] / "docs"
PYTHON_TIMEOUT_S = 10.0
MAX_EXPONENT = 64


def _schema(name: str, description: str, **properties: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string", "description": text} for key, text in properties.items()},
                "required": list(properties),
            },
        },
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "calculator": _schema("calculator", "Evaluate arithmetic.", expression="e.g. 3*(4+5)"),
    "search": _schema("search", "Search the company documents.", query="keywords"),
    "write_file": _schema("write_file", "Write a text file.", path="file name", content="text"),
    "run_python": _schema("run_python", "Run a Python program and return its output.", code="program"),
}

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def calculator(expression: str) -> str:
    """Exact rational arithmetic: + - * / // % ** and parentheses on integers and decimals."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"cannot parse {expression!r}: {error.msg}") from None
    value = _evaluate(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6g}"


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
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


@cache
def documents() -> tuple[tuple[str, str], ...]:
    """(document name, line) for every non-empty line of the shipped documents, in file order."""
    lines = []
    for path in sorted(DOCS_DIR.glob("*.txt")):
        lines += [(path.name, line.strip()) for line in path.read_text().splitlines() if line.strip()]
    return tuple(lines)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def search(query: str) -> str:
    """The lines sharing the most words with the query (at most two, in document order)."""
    wanted = _words(query)
    if not wanted:
        raise ValueError("the query has no words")
    scored = [(len(wanted & _words(line)), name, line) for name, line in documents()]
    best = max(score for score, _, _ in scored)
    if best == 0:
        return "no results"
    hits = [f"{name}: {line}" for score, name, line in scored if score == best][:2]
    return "\n".join(hits)


def write_file(path: str, content: str, workspace: Path) -> str:
    """Write `content` to `path` inside the workspace (no escaping it)."""
    target = (workspace / path).resolve()
    if not target.is_relative_to(workspace.resolve()) or target == workspace.resolve():
        raise ValueError(f"path {path!r} is outside the workspace")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)
    return f"wrote {len(content)} characters to {path}"


def run_python(code: str, workspace: Path, timeout: float = PYTHON_TIMEOUT_S) -> str:
    """Run `code` in a fresh isolated interpreter (-I: no user site or environment; -S: no
    site-packages) with the workspace as working directory; stdout, then the error line if it failed."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-"],
            input=code,
            capture_output=True,
            text=True,
            cwd=workspace,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"error: timed out after {timeout:g} s"
    output = done.stdout.strip()
    if done.returncode != 0:
        errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
        output = "\n".join(filter(None, [output, errors[-1] if errors else f"exit code {done.returncode}"]))
    return output or "(no output)"
