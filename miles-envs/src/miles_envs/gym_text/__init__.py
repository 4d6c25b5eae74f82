"""Gymnasium-style text environments (``reset`` / ``step`` on text) played through the TITO session server
(:mod:`miles_envs.gym_text.episode`), and the ``env_return`` reward (:mod:`miles_envs.gym_text.reward`): the loop
the ``openenv`` and ``text_game`` rollout functions share. Needs no extra."""

from __future__ import annotations

__all__: list[str] = []
