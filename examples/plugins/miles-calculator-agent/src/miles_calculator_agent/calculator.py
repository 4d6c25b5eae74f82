"""The calculator tool: its OpenAI definition and a safe evaluator of arithmetic expressions."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

__all__ = ["CALCULATOR_TOOL", "calculate"]

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
}
"""The tool as agents pass it in ``tools`` (OpenAI's function-tool shape)."""

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right:g} is too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def calculate(expression: str) -> str:
    """The value of ``expression`` as text (integers without a decimal point), or ``error: ...``.

    Only numbers, ``+ - * / // % **`` and parentheses are accepted; nothing is ``eval``-ed.
    """
    try:
        result = _value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"
    if isinstance(result, float) and (math.isnan(result) or math.isinf(result)):
        return "error: not a finite number"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"
