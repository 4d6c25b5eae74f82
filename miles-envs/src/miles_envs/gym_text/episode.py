"""Step/reset text environments (the Gymnasium API with text observations and text actions) as rollout functions.

A :class:`TextEnv` is anything with Gymnasium's two calls, on strings::

    observation, info = env.reset(seed=seed)
    observation, reward, terminated, truncated, info = env.step(action)

:class:`TextEnvRollout` plays one episode of it per sample through the TITO session server: every
observation becomes a user message, the policy's reply (an OpenAI chat completion on the session, so its
tokens are recorded exactly, with ``loss_mask`` 1) is the action, and ``step`` follows until the episode
terminates, is truncated or reaches ``max_turns``. The environment's text reaches the sample as the tokens
of the next prompt (``loss_mask`` 0: never in the loss). The rewards ``step`` returned go into the sample's
metadata (``env_rewards``, ``env_return``), which the ``env_return`` reward
(:class:`~miles_envs.gym_text.reward.EnvReturn`) makes the sample's reward.

The data set picks the episodes: a row's ``env_seed`` is the seed of ``reset`` (default: one derived from
the prompt's text), so the ``n_samples_per_prompt`` episodes of a prompt (its GRPO group) play the same game;
the prompt's text itself is not shown to the policy (a ``system`` message of the data is).

Environments are synchronous (Gymnasium's API is): their calls run in a worker thread, one environment per
episode. The ``gym_text`` rollout function (:class:`GymTextRollout`) serves any factory of such an environment;
:mod:`miles_envs.text_games.games` (textarena) and :mod:`miles_envs.openenv.rollout` build on the same loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import Field, field_validator

from miles.components import Component, ComponentSettings, Requirement, SettingsT
from miles.errors import SettingsError
from miles.sessions.rollout import EpisodeContext, SessionRollout

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings
    from miles.types import Sample

__all__ = [
    "OPENAI",
    "GymTextRollout",
    "GymTextSettings",
    "TextEnv",
    "TextEnvRollout",
    "TextEnvSettings",
    "episode_seed",
    "load_object",
]

log = logging.getLogger(__name__)

OPENAI = Requirement("openai", extra="gym", distribution="miles-envs")
"""The chat client of every episode (each extra of an environment library installs it too)."""


class TextEnv(Protocol):
    """A Gymnasium-style environment whose observations and actions are text."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode: its first observation and an info dict."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Act: ``(observation, reward, terminated, truncated, info)``."""

    def close(self) -> None:
        """Release what the environment holds."""


class TextEnvSettings(ComponentSettings):
    """What every text-environment rollout function takes."""

    max_turns: int = Field(8, ge=1)
    """Policy turns per episode at most; an episode still running then ends truncated."""
    system_prompt: str | None = None
    """A system message before the first observation (the data's own system message wins)."""


def load_object(ref: str, *, field: str) -> Any:
    """The object ``package.module:attribute`` names; a :class:`SettingsError` naming ``field`` when it cannot be
    imported."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise SettingsError(f"{field}: expected 'package.module:attribute', got {ref!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SettingsError(f"{field}: cannot import {module_name!r} ({ref!r}): {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SettingsError(f"{field}: module {module_name!r} has no attribute {attr!r}") from None


def episode_seed(sample: Sample) -> int:
    """The ``reset`` seed of ``sample``'s episode: its ``env_seed`` metadata, else one derived from its prompt text
    (equal for the samples of a group)."""
    seed = sample.metadata.get("env_seed")
    if seed is not None:
        return int(seed)
    text = sample.prompt if isinstance(sample.prompt, str) else repr(sample.prompt)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def _finite(value: Any) -> float:
    reward = float(value or 0.0)
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise ValueError(f"the environment returned a reward that is not finite: {value!r}")
    return reward


class TextEnvRollout(SessionRollout, Component[SettingsT]):
    """A rollout function that plays a :class:`TextEnv` episode per sample through the session server.

    Subclasses say how an environment is made (:meth:`make_env`, called in a worker thread once per episode).
    """

    def __init__(self, settings: SettingsT) -> None:
        Component.__init__(self, settings)
        SessionRollout.__init__(self, self.play, description=type(self).__doc__)

    @abstractmethod
    def make_env(self, sample: Sample) -> TextEnv:
        """A fresh environment for ``sample``'s episode (runs in a worker thread)."""

    @property
    def _options(self) -> TextEnvSettings:
        settings = self.settings
        assert isinstance(settings, TextEnvSettings)
        return settings

    def _first_messages(self, ctx: EpisodeContext) -> list[dict[str, Any]]:
        system = [m for m in ctx.messages if m.get("role") in ("system", "developer")][:1]
        if not system and self._options.system_prompt:
            system = [{"role": "system", "content": self._options.system_prompt}]
        return system

    async def play(self, ctx: EpisodeContext) -> dict[str, Any]:
        """One episode (the :data:`~miles.sessions.rollout.Episode` of this rollout function)."""
        import openai

        env = await asyncio.to_thread(self.make_env, ctx.sample)
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        rewards: list[float] = []
        terminated = truncated = False
        try:
            observation, _ = await asyncio.to_thread(env.reset, seed=episode_seed(ctx.sample))
            messages = [*self._first_messages(ctx), {"role": "user", "content": str(observation)}]
            for _ in range(self._options.max_turns):
                reply = await client.chat.completions.create(
                    model="policy",
                    messages=messages,  # type: ignore[arg-type]  # plain dicts in OpenAI's shape
                    max_tokens=ctx.max_tokens,
                )
                action = reply.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": action})
                observation, reward, terminated, truncated, _ = await asyncio.to_thread(env.step, action)
                rewards.append(_finite(reward))
                if terminated or truncated:
                    break
                messages.append({"role": "user", "content": str(observation)})
            else:
                truncated = True
        finally:
            await client.close()
            await asyncio.to_thread(env.close)
        return {
            "env_rewards": rewards,
            "env_return": sum(rewards),
            "env_turns": len(rewards),
            "env_terminated": bool(terminated),
            "env_truncated": bool(truncated),
        }

    def metrics(self, samples: Sequence[Sample]) -> dict[str, float]:
        """The session metrics and ``env/*``: the mean return, turns and terminated fraction of the episodes."""
        out = super().metrics(samples)
        played = [s for s in samples if "env_return" in s.metadata]
        if played:
            n = len(played)
            out["env/return_mean"] = sum(float(s.metadata["env_return"]) for s in played) / n
            out["env/turns_mean"] = sum(int(s.metadata["env_turns"]) for s in played) / n
            out["env/terminated_fraction"] = sum(bool(s.metadata["env_terminated"]) for s in played) / n
        return out


class GymTextSettings(TextEnvSettings):
    """Settings of the ``gym_text`` rollout function."""

    env: str
    """The environment's factory, ``package.module:callable`` (a class or a function returning a
    :class:`TextEnv`), called with ``kwargs`` once per episode."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the factory."""

    @field_validator("env")
    @classmethod
    def _reference(cls, value: str) -> str:
        module, sep, attr = value.partition(":")
        if not (sep and module and attr):
            raise ValueError(f"expected 'package.module:callable', got {value!r}")
        return value


class GymTextRollout(TextEnvRollout[GymTextSettings]):
    """Episodes of a Gymnasium-style text environment (``env``: its factory) through the session server."""

    name: ClassVar[str] = "gym_text"
    requires: ClassVar[tuple[Requirement, ...]] = (OPENAI,)

    def __init__(self, settings: GymTextSettings) -> None:
        super().__init__(settings)
        self._factory: Callable[..., TextEnv] | None = None

    @classmethod
    def check_settings(cls, options: GymTextSettings, settings: MilesSettings | None) -> None:
        """Refuse a factory that does not import or is not callable, naming ``rollout.function.env``."""
        factory = load_object(options.env, field="rollout.function.env")
        if not callable(factory):
            raise SettingsError(f"rollout.function.env: {options.env!r} is not callable")

    def make_env(self, sample: Sample) -> TextEnv:
        if self._factory is None:
            self._factory = load_object(self.settings.env, field="rollout.function.env")
        assert self._factory is not None
        env = self._factory(**self.settings.kwargs)
        return env
