"""OpenEnv environment servers as services of a run (``pip install "miles-envs[openenv]"``): the ``openenv`` rollout
function (:mod:`miles_envs.openenv.rollout`), the server ``miles train`` starts (:mod:`miles_envs.openenv.server`)
and a small environment for examples and tests (:mod:`miles_envs.openenv.letters`)."""

from __future__ import annotations

__all__: list[str] = []
