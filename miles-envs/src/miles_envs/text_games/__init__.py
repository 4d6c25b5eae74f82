"""Single-player textarena games through the Gymnasium text adapter (``pip install "miles-envs[textarena]"``): the
``text_game`` rollout function (:mod:`miles_envs.text_games.games`)."""

from __future__ import annotations

__all__: list[str] = []
