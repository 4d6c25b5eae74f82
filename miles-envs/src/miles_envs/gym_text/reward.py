"""The ``env_return`` reward: what an environment paid out during the episode becomes the sample's reward."""

from __future__ import annotations

from typing import ClassVar, Literal

from miles.components import ComponentSettings
from miles.rewards.base import Reward, RewardOutput
from miles.types import Sample

__all__ = ["EnvReturn", "EnvReturnSettings"]


class EnvReturnSettings(ComponentSettings):
    """Settings of ``env_return``."""

    aggregate: Literal["sum", "last", "mean"] = "sum"
    """How the rewards of an episode's steps become one number: their sum (the return), the last step's, or
    their mean (a return that does not grow with the number of turns)."""


class EnvReturn(Reward[EnvReturnSettings]):
    """The rewards an environment returned during the episode (``metadata["env_rewards"]``, written by the
    environment rollout functions of miles-envs), as the sample's reward; ``turns`` and ``terminated`` are
    logged as parts. A sample without them (a rollout function that played no environment) is an error, so the
    sample fails with the reason instead of training on a made-up 0."""

    name: ClassVar[str] = "env_return"

    async def score(self, sample: Sample) -> RewardOutput:
        rewards = sample.metadata.get("env_rewards")
        if not isinstance(rewards, list):
            raise ValueError(
                "env_return: the sample has no env_rewards: select an environment rollout function "
                "(rollout.function = openenv, text_game or gym_text)"
            )
        values = [float(r) for r in rewards]
        aggregate = self.settings.aggregate
        if not values:
            value = 0.0
        elif aggregate == "sum":
            value = sum(values)
        elif aggregate == "last":
            value = values[-1]
        else:
            value = sum(values) / len(values)
        parts = {"turns": float(len(values)), "terminated": float(bool(sample.metadata.get("env_terminated")))}
        return RewardOutput(value, parts)
