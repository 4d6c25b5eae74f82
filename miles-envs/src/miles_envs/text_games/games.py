"""The ``text_game`` rollout function: single-player `textarena <https://github.com/LeonGuertler/TextArena>`_ games
(``pip install "miles-envs[textarena]"``) as Gymnasium-style text environments (:mod:`miles_envs.gym_text.episode`).

``game`` is a textarena id (``GuessTheNumber-v0``, ``Wordle-v0``, ``TowerOfHanoi-v0`` ...; one player, no
opponent model). :class:`TextArenaEnv` gives it the Gymnasium API: ``reset(seed)`` returns the game's prompt,
``step(reply)`` the game's messages since the last turn, and the game's reward for the player when it ends (0
before). The game is made without textarena's observation wrappers by default (``-raw``): the chat already holds
the history, which those wrappers would repeat in every observation.
"""

from __future__ import annotations

import random
import threading
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from miles.components import Requirement
from miles.errors import SettingsError
from miles_envs.gym_text.episode import OPENAI, TextEnvRollout, TextEnvSettings

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings
    from miles.types import Sample

__all__ = ["TEXTARENA", "TextArenaEnv", "TextGameRollout", "TextGameSettings"]

TEXTARENA = Requirement("textarena", extra="textarena", distribution="miles-envs")
"""What the ``text_game`` rollout function imports."""

_RESET_LOCK = threading.Lock()
"""textarena seeds Python's global ``random`` in ``reset`` and games draw from it right after: one reset at a time,
the global stream restored after it (a game that draws in ``step`` too draws from the process's stream)."""


class TextArenaEnv:
    """A single-player textarena game with the Gymnasium text API (:class:`~miles_envs.gym_text.episode.TextEnv`)."""

    def __init__(self, game: str, *, raw: bool = True, **kwargs: Any) -> None:
        import textarena as ta

        self.game = game
        self.env = ta.make(f"{game}-raw" if raw and f"{game}-raw" in _registry() else game, **kwargs)

    def _observation(self) -> str:
        _, messages = self.env.get_observation()
        return "\n".join(str(m[1]).strip() for m in messages if str(m[1]).strip())

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        with _RESET_LOCK:  # (the process's own random stream is left as it was)
            outside = random.getstate()
            try:
                self.env.reset(num_players=1, seed=seed)
            finally:
                random.setstate(outside)
        return self._observation(), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        done, info = self.env.step(action)
        observation = self._observation()
        if not done:
            return observation, 0.0, False, False, dict(info or {})
        rewards, game_info = self.env.close()
        reward = float((rewards or {}).get(0, 0.0))
        return observation, reward, True, False, {**dict(info or {}), **dict(game_info.get(0, {}))}

    def close(self) -> None:
        """Nothing to release (a finished game was closed by :meth:`step`)."""


def _registry() -> dict[str, Any]:
    from textarena.envs.registration import ENV_REGISTRY

    registry: dict[str, Any] = ENV_REGISTRY
    return registry


class TextGameSettings(TextEnvSettings):
    """Settings of the ``text_game`` rollout function (``[rollout.function] name = "text_game"``)."""

    game: str
    """The textarena game id (``GuessTheNumber-v0`` ...): a single-player game."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The game's own options (``{max_number = 10, max_turns = 4}``), passed to ``textarena.make``."""
    raw: bool = True
    """Make the game without textarena's observation wrappers (the chat holds the history)."""


class TextGameRollout(TextEnvRollout[TextGameSettings]):
    """Episodes of a single-player textarena game through the session server."""

    name: ClassVar[str] = "text_game"
    requires: ClassVar[tuple[Requirement, ...]] = (TEXTARENA, OPENAI)

    @classmethod
    def check_settings(cls, options: TextGameSettings, settings: MilesSettings | None) -> None:
        """Refuse a game textarena does not know, or one for more than one player, naming ``rollout.function.game``."""
        import textarena  # noqa: F401  (registers the games)

        registry = _registry()
        if options.game not in registry:
            near = sorted(k for k in registry if options.game.split("-")[0].lower() in k.lower())[:5]
            raise SettingsError(
                f"rollout.function.game: textarena has no game {options.game!r}"
                + (f" (did you mean {', '.join(near)}?)" if near else "")
            )
        try:
            env = TextArenaEnv(options.game, raw=options.raw, **options.options)
            env.reset(seed=0)
        except AssertionError as exc:  # textarena's single-player state asserts num_players == 1
            raise SettingsError(
                f"rollout.function.game: {options.game!r} is not a single-player game ({exc})"
            ) from None
        except TypeError as exc:
            raise SettingsError(f"rollout.function.options: {options.game!r} refuses them: {exc}") from None

    def make_env(self, sample: Sample) -> TextArenaEnv:
        return TextArenaEnv(self.settings.game, raw=self.settings.raw, **self.settings.options)
