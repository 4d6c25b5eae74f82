"""The reward interface: an async function of a sample that returns a number (or named parts)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from miles.components import Component, SettingsT

if TYPE_CHECKING:
    from miles.types import Sample

__all__ = ["Reward", "RewardOutput"]


@dataclass
class RewardOutput:
    """A reward with named parts (``value`` is what trains; parts are logged)."""

    value: float
    parts: dict[str, float] = field(default_factory=dict)


class Reward(Component[SettingsT], ABC):
    """A reward function. Registered with ``miles_register_rewards``.

    ``score`` may be slow (a remote model, a sandbox); the rollout manager runs it with the timeout of
    the ``reward`` settings, and an exception or a timeout marks the sample failed with the reason.
    """

    @abstractmethod
    async def score(self, sample: Sample) -> float | RewardOutput:
        """Score one completed sample (``sample.response``, ``sample.label``, ``sample.metadata``)."""

    async def close(self) -> None:
        """Release connections (HTTP clients ...)."""
