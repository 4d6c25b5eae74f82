"""The plugin module the ``envs`` entry point names: the environment rollout functions and their reward.

It imports none of the environment libraries (each rollout function imports its own when it runs, and the run
refuses to start when its extra is missing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import miles
from miles_envs.gym_text import GymTextRollout
from miles_envs.openenv import OpenEnvRollout
from miles_envs.rewards import EnvReturn
from miles_envs.text_games import TextGameRollout

if TYPE_CHECKING:
    from miles.components import Register


@miles.hookimpl
def miles_register_rollout_functions(register: Register) -> None:
    """Register ``openenv``, ``text_game`` and ``gym_text``."""
    register(OpenEnvRollout)
    register(TextGameRollout)
    register(GymTextRollout)


@miles.hookimpl
def miles_register_rewards(register: Register) -> None:
    """Register ``env_return``."""
    register(EnvReturn)
