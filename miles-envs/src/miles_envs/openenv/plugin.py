"""The plugin module the ``openenv`` entry point names: the ``openenv`` rollout function. It imports no OpenEnv
(the rollout function imports it when it runs; a run that selects it without ``miles-envs[openenv]`` is refused
at start, naming the extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import miles
from miles_envs.openenv.rollout import OpenEnvRollout

if TYPE_CHECKING:
    from miles.components import Register


@miles.hookimpl
def miles_register_rollout_functions(register: Register) -> None:
    """Register ``openenv`` (its reward is ``env_return``, registered by the ``gym_text`` plugin)."""
    register(OpenEnvRollout)
