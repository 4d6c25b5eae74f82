"""The ``python_output`` reward: the response's Python program, run in the sandbox, against the label.

The last fenced code block of the response (```` ```python ```` or a bare ```` ``` ````) runs in
:mod:`miles.rewards.sandbox` (time, memory, file-size limits, no network) with the label's ``stdin`` if any; its
standard output, stripped, is compared with the expected output (the label, or its ``output_key``). A program
that exits with an error, times out or hits a limit fails the sample with the sandbox's reason (or scores
``failure_reward`` when that is set); a response without a code block scores ``no_code``.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from miles.components import ComponentSettings
from miles.rewards.base import Reward, RewardOutput
from miles.rewards.sandbox import SandboxError, SandboxLimits, run_python
from miles.types import Sample

__all__ = ["PythonOutputReward", "PythonOutputSettings", "extract_code"]

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str | None:
    """The last fenced code block of ``text`` (``python``, ``py`` or no language), or ``None``."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else None


class PythonOutputSettings(ComponentSettings):
    """Settings of the ``python_output`` reward."""

    sandbox: SandboxLimits = Field(default_factory=SandboxLimits)
    """The sandbox's limits (``timeout``, ``memory_mb``, ``file_size_mb`` ...)."""
    output_key: str = "output"
    """Key of the expected output when the label is a dict (whose ``stdin`` key, if any, is the input)."""
    correct: float = 1.0
    """Reward of a program that prints the expected output."""
    incorrect: float = 0.0
    """Reward of a program that runs and prints something else."""
    no_code: float = 0.0
    """Reward of a response without a code block."""
    failure_reward: float | None = None
    """Reward of a program that fails in the sandbox (error, timeout, a limit); unset: the sample fails, with
    the sandbox's reason."""


class PythonOutputReward(Reward[PythonOutputSettings]):
    """Runs the response's program in the sandbox and checks what it prints."""

    name = "python_output"

    def expected(self, sample: Sample) -> tuple[str, str]:
        """``(stdin, expected output)`` of ``sample``'s label."""
        label: Any = sample.label
        if isinstance(label, dict):
            if self.settings.output_key not in label:
                raise ValueError(f"the label has no {self.settings.output_key!r} (keys: {', '.join(map(str, label))})")
            return str(label.get("stdin", "")), str(label[self.settings.output_key])
        return "", "" if label is None else str(label)

    async def score(self, sample: Sample) -> RewardOutput:
        s = self.settings
        code = extract_code(sample.response)
        if code is None:
            return RewardOutput(s.no_code, {"has_code": 0.0})
        stdin, want = self.expected(sample)
        result = await run_python(code, stdin=stdin, limits=s.sandbox)
        if not result.ok:
            if s.failure_reward is None:
                raise SandboxError(f"the program failed in the sandbox: {result.reason}")
            return RewardOutput(s.failure_reward, {"has_code": 1.0, "ran": 0.0})
        value = s.correct if result.stdout.strip() == want.strip() else s.incorrect
        return RewardOutput(value, {"has_code": 1.0, "ran": 1.0})
