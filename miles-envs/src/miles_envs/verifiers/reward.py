"""The ``verifiers`` reward: the environment's rubric score of each episode.

The ``verifiers`` rollout function scores every episode with the environment's rubric when it ends (see
:mod:`miles_envs.verifiers.rollout`); this reward hands that score on: the rubric's reward (the weighted sum
of its reward functions) is the value, and each function's own value — metrics of weight 0 such as
``num_turns`` included — is a named part, logged as ``reward/verifiers/<function>/mean``.

A rubric with group-level reward functions scores the episodes of a GRPO group together: the reward is a
:class:`~miles.rewards.base.GroupReward`, which the rollout manager calls once per group when all its episodes
are played, and it hands the group's waiting episodes to the rubric (:mod:`miles_envs.verifiers.groups`) before
handing their scores on, every function's value a part as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles.components import ComponentSettings
from miles.errors import SettingsError
from miles.rewards.base import GroupReward, RewardOutput
from miles_envs.verifiers.groups import score_pending
from miles_envs.verifiers.loading import VERIFIERS

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings
    from miles.types import Sample

__all__ = ["VerifiersReward"]


def _rubric_score(sample: Sample) -> RewardOutput:
    info = sample.metadata.get("verifiers")
    if not isinstance(info, dict) or "reward" not in info:
        raise ValueError(
            "the sample carries no rubric score (metadata 'verifiers'): it was not played by the 'verifiers' "
            "rollout function"
        )
    if info["reward"] is None:
        raise ValueError(f"the environment's rubric gave no finite reward (error: {info.get('error')})")
    return RewardOutput(float(info["reward"]), {str(k): float(v) for k, v in info.get("metrics", {}).items()})


class VerifiersReward(GroupReward[ComponentSettings]):
    """The rubric score of a verifiers environment's episode (``rollout.function = "verifiers"``); a rubric's
    group functions score the episodes of a group together."""

    name = "verifiers"
    requires = (VERIFIERS,)

    @classmethod
    def check_settings(cls, options: ComponentSettings, settings: MilesSettings) -> None:
        """Before anything starts: the run plays verifiers episodes (the score is theirs)."""
        if settings.rollout.function_name != "verifiers":
            raise SettingsError(
                "reward.functions: the 'verifiers' reward is the rubric score of the 'verifiers' rollout "
                f"function's episodes; rollout.function is {settings.rollout.function_name!r}"
            )

    async def score_group(self, samples: Sequence[Sample]) -> list[float | RewardOutput | Exception]:
        """The group's waiting episodes scored together by their rubric, then each sample's rubric score; a
        sample without one gets the error in place of its score (it fails alone)."""
        failures = await score_pending(samples)
        out: list[float | RewardOutput | Exception] = []
        for i, sample in enumerate(samples):
            if i in failures:
                out.append(failures[i])
                continue
            try:
                out.append(_rubric_score(sample))
            except ValueError as exc:
                out.append(exc)
        return out
