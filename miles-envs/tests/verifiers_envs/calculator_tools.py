"""A verifiers tool environment for the tests: ``vf.ToolEnv`` with a calculator tool (the function's signature
and docstring are its definition), arithmetic questions, and a rubric that scores the final ``ANSWER: n``."""

from __future__ import annotations

import re
from typing import Any

import verifiers as vf
from datasets import Dataset

SYSTEM = "You are a calculator agent. Call the calculator for every sum, then reply with ANSWER: <number>."


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. 12 * (3 + 4)
    """
    if not re.fullmatch(r"[\d\s+\-*/().]+", expression):
        return "error: not arithmetic"
    try:
        value = eval(expression, {"__builtins__": {}})  # digits and operators only (checked above)
    except (SyntaxError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def answered(completion: Any, answer: str) -> float:
    """1 when the last reply says ``ANSWER: <the answer>``."""
    replies = [m for m in completion if m.get("role") == "assistant"]
    found = re.findall(r"ANSWER:\s*(-?\d+)", str(replies[-1].get("content") or "")) if replies else []
    return 1.0 if found and found[-1] == answer else 0.0


def load_environment(max_turns: int = 3) -> vf.Environment:
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(12, 30), (7, 8), (21, 5), (9, 9)]]
    return vf.ToolEnv(
        dataset=Dataset.from_list(rows),
        system_prompt=SYSTEM,
        tools=[calculator],
        rubric=vf.Rubric(funcs=[answered]),
        max_turns=max_turns,
    )
