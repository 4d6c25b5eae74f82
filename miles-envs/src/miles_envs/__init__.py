"""Environment libraries for Miles, played through the TITO session server (exact tokens, environment text never
in the loss): OpenEnv servers (:mod:`miles_envs.openenv`), Gymnasium-style text environments
(:mod:`miles_envs.gym_text`) and textarena games (:mod:`miles_envs.text_games`); the ``env_return`` reward."""

from __future__ import annotations

__all__: list[str] = []
