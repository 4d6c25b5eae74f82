"""Plugins built in a test: an object holding hook implementations, and one that registers components.

::

    from miles.testing import check_plugin, registering

    def test_my_two_rewards_conform():
        check_plugin(registering("miles_register_rewards", Brevity, Politeness), name="my_rewards")

:class:`LengthReward` is a small conforming reward with its own settings, for the kit's own tests and
examples.
"""

from __future__ import annotations

import types
from typing import Any

from pydantic import Field

from miles.components import ComponentSettings
from miles.markers import hookimpl
from miles.rewards.base import Reward, RewardOutput
from miles.types import Sample

__all__ = ["LengthReward", "LengthSettings", "plugin_of", "registering"]


def plugin_of(**hooks: Any) -> types.SimpleNamespace:
    """A plugin object holding ``hooks`` (hook implementations or plain attributes)."""
    return types.SimpleNamespace(**hooks)


def registering(hook_name: str, *components: Any) -> types.SimpleNamespace:
    """A plugin whose registration hook ``hook_name`` registers ``components`` (each by its ``name``)."""

    def hook(register: Any) -> None:
        for component in components:
            register(component)

    hook.__name__ = hook_name
    return plugin_of(**{hook_name: hookimpl(hook)})


class LengthSettings(ComponentSettings):
    """Settings of the ``length`` reward."""

    target: int = Field(8, ge=1)
    """Target response length in words."""


class LengthReward(Reward[LengthSettings]):
    """1.0 at the target length, falling linearly to 0.0 at twice (or zero times) the target."""

    name = "length"

    async def score(self, sample: Sample) -> RewardOutput:
        words = len(sample.response.split())
        value = max(0.0, 1.0 - abs(words - self.settings.target) / self.settings.target)
        return RewardOutput(value, {"words": float(words)})
