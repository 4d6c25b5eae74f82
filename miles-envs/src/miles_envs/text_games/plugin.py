"""The plugin module the ``text_games`` entry point names: the ``text_game`` rollout function. It imports no
textarena (the rollout function imports it when it runs; a run that selects it without
``miles-envs[textarena]`` is refused at start, naming the extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import miles
from miles_envs.text_games.games import TextGameRollout

if TYPE_CHECKING:
    from miles.components import Register


@miles.hookimpl
def miles_register_rollout_functions(register: Register) -> None:
    """Register ``text_game`` (its reward is ``env_return``, registered by the ``gym_text`` plugin)."""
    register(TextGameRollout)
