"""The plugin module the ``gym_text`` entry point names: the ``gym_text`` rollout function (any Gymnasium-style text
environment) and the ``env_return`` reward, which the ``openenv`` and ``text_game`` rollout functions use too."""

from __future__ import annotations

from typing import TYPE_CHECKING

import miles
from miles_envs.gym_text.episode import GymTextRollout
from miles_envs.gym_text.reward import EnvReturn

if TYPE_CHECKING:
    from miles.components import Register


@miles.hookimpl
def miles_register_rollout_functions(register: Register) -> None:
    """Register ``gym_text``."""
    register(GymTextRollout)


@miles.hookimpl
def miles_register_rewards(register: Register) -> None:
    """Register ``env_return``."""
    register(EnvReturn)
