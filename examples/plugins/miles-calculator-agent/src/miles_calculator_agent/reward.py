"""The ``calculator_answer`` reward: 1 when the episode's final answer equals the label."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from miles.components import ComponentSettings
from miles.rewards.base import Reward
from miles.types import Sample

__all__ = ["CalculatorAnswer", "CalculatorAnswerSettings"]


class CalculatorAnswerSettings(ComponentSettings):
    """Settings of ``calculator_answer``."""

    tolerance: float = Field(1e-6, ge=0.0)
    """Largest difference between the answer and the label that still counts as correct."""
    tool_bonus: float = Field(0.0, ge=0.0)
    """Added for an episode that called the calculator at least once (shaping; 0 = off)."""


class CalculatorAnswer(Reward[CalculatorAnswerSettings]):
    """1.0 when ``metadata["answer"]`` (written by the episode) equals the label, else 0.0."""

    name: ClassVar[str] = "calculator_answer"

    async def score(self, sample: Sample) -> float:
        settings = self.settings
        bonus = settings.tool_bonus if sample.metadata.get("calculator_calls", 0) else 0.0
        answer, label = sample.metadata.get("answer"), sample.label
        if answer is None or label is None:
            return bonus
        try:
            correct = abs(float(answer) - float(label)) <= settings.tolerance
        except (TypeError, ValueError):
            return bonus
        return (1.0 if correct else 0.0) + bonus
