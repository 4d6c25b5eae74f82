"""The ``reasoning_gym`` reward: the task's own verifier (reasoning-gym's ``score_answer``) on the response's
answer, for prompts of the ``reasoning_gym`` data source (whose label holds the task entry).

The answer is the last ``<answer>...</answer>`` of the response (``extract = "answer_tag"``, what the data
source's default instruction asks for), the last ``\\boxed{}``, or the whole response; a response without one
scores ``no_answer``. The verifier's score (0 to 1; partial credit where the task gives it) is the reward.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Literal

from miles.components import ComponentSettings
from miles.data.reasoning_gym import REASONING_GYM
from miles.rewards.answers import extract_boxed
from miles.rewards.base import Reward, RewardOutput
from miles.types import Sample

__all__ = ["ReasoningGymReward", "ReasoningGymRewardSettings", "extract_answer"]

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str, how: str) -> str | None:
    """The answer of ``text``: the last ``<answer>`` tag's content, the last ``\\boxed{}``, or all of it."""
    if how == "answer_tag":
        found = _ANSWER.findall(text)
        return found[-1].strip() if found else None
    if how == "boxed":
        return extract_boxed(text)
    return text.strip()


class ReasoningGymRewardSettings(ComponentSettings):
    """Settings of the ``reasoning_gym`` reward."""

    extract: Literal["answer_tag", "boxed", "none"] = "answer_tag"
    """Where the answer is in the response."""
    no_answer: float = 0.0
    """Reward of a response without an answer."""


class ReasoningGymReward(Reward[ReasoningGymRewardSettings]):
    """reasoning-gym's verifier of the sample's task."""

    name = "reasoning_gym"
    requires = (REASONING_GYM,)

    async def score(self, sample: Sample) -> RewardOutput:
        label: Any = sample.label
        entry = label.get("entry") if isinstance(label, dict) else None
        if not isinstance(entry, dict) or "source_dataset" not in entry.get("metadata", {}):
            raise ValueError(
                "the label holds no reasoning-gym task entry (label.entry.metadata.source_dataset): use the "
                "reasoning_gym data source"
            )
        answer = extract_answer(sample.response, self.settings.extract)
        if answer is None:
            return RewardOutput(self.settings.no_answer, {"has_answer": 0.0})
        rg = REASONING_GYM.load("reward 'reasoning_gym'")
        verify = rg.get_score_answer_fn(entry["metadata"]["source_dataset"])
        value = await asyncio.to_thread(verify, answer, entry)
        return RewardOutput(float(value), {"has_answer": 1.0})
