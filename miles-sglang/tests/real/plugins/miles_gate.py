"""A test plugin: the ``gate`` reward holds a run between a rollout's generation and its training.

It scores 0. While the file ``path`` exists, the scoring of each sample after the first ``after`` (scoring
follows generation) notes the sample in ``path.waiting`` and waits for the file to go. ``test_train.py`` puts this folder on ``PYTHONPATH`` with an
entry point (``miles.plugins``)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from miles.components import ComponentSettings
from miles.markers import hookimpl
from miles.rewards.base import Reward


class GateSettings(ComponentSettings):
    path: str
    """While this file exists, scoring waits."""
    after: int = 0
    """Samples scored before the gate applies (``16``: the first step of 4 prompts x 4 samples goes through)."""


class Gate(Reward[GateSettings]):
    """Scores 0, waiting while the gate file exists."""

    name = "gate"
    scored = 0

    async def score(self, sample: Any) -> float:
        self.scored += 1
        if self.scored <= self.settings.after:
            return 0.0
        if os.path.exists(self.settings.path):
            with open(self.settings.path + ".waiting", "a") as out:
                out.write(f"{sample.group_id} {sample.index}\n")
        while os.path.exists(self.settings.path):
            await asyncio.sleep(0.05)
        return 0.0


@hookimpl
def miles_register_rewards(register: Any) -> None:
    register(Gate)
