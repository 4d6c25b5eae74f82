"""The ``openenv`` rollout function: episodes of an `OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ environment
server (``pip install "miles-envs[openenv]"``), played through Miles' TITO session server.

An OpenEnv environment is a server (``openenv.core.env_server.create_app``) that speaks ``reset`` / ``step`` with
typed actions and observations over a WebSocket session (``/ws``), one environment instance per connection.
``env`` names one — an ``Environment`` subclass parametrised with its action and observation types, or the
FastAPI app ``create_app`` made (``my_env.server.app:app``, OpenEnv's layout) — and ``miles train`` starts
its server through the launcher as a process of the run (``python -m miles_envs.openenv.server``: on
``cluster.host``, its log ``logs/env-openenv.log`` in the run directory, the run's API key required where
the run has one, restarted once if it dies, stopped with the run). ``url`` instead reaches a server that
already runs.

Each episode opens its own session (OpenEnv's ``GenericEnvClient``), resets it with the episode's seed, and
plays it as :mod:`miles_envs.gym_text.episode` plays any text environment: an observation is rendered as a user
message (its ``observation_field``; by default its one text field, else its fields as JSON), the policy's
reply becomes the action (its ``action_field``; by default the action's one text field), ``step`` until
``done``; the observations' rewards are the episode's rewards (the ``env_return`` reward).
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from miles.components import Requirement
from miles.errors import SettingsError
from miles.rewards.base import RewardServer
from miles_envs.gym_text.episode import OPENAI, TextEnvRollout, TextEnvSettings, load_object

if TYPE_CHECKING:
    from miles.rollout.client import EngineClient
    from miles.settings.model import MilesSettings, RolloutSettings
    from miles.types import Sample

__all__ = ["OPENENV", "OpenEnvRollout", "OpenEnvSettings", "OpenEnvText", "text_fields"]

log = logging.getLogger(__name__)

OPENENV = Requirement("openenv", extra="openenv", distribution="miles-envs", package="openenv-core")
"""What the ``openenv`` rollout function imports."""

_RESERVED = frozenset({"done", "reward", "metadata"})
"""Observation fields OpenEnv moves out of the observation (and the action's ``metadata``)."""


class OpenEnvSettings(TextEnvSettings):
    """Settings of the ``openenv`` rollout function (``[rollout.function] name = "openenv"``)."""

    env: str | None = None
    """The environment the run serves, ``package.module:attribute``: an OpenEnv ``Environment`` subclass
    (declared ``Environment[MyAction, MyObservation, State]``) or the app ``create_app`` made. ``miles train``
    starts its server; leave it unset and set ``url`` for a server that already runs."""
    url: str | None = None
    """An OpenEnv server that already runs (``http://host:port``); set by ``miles train`` to the server it
    started for ``env``."""
    api_key_env: str | None = None
    """With ``url``: the environment variable holding that server's key (default: the run's own key)."""
    max_concurrent_envs: int = Field(64, ge=1)
    """Sessions (episodes) the started server holds at once (OpenEnv's ``max_concurrent_envs``; more than 1
    needs an environment marked ``SUPPORTS_CONCURRENT_SESSIONS``)."""
    action_field: str | None = None
    """The action field that receives the policy's reply (default: the action's one text field)."""
    observation_field: str | None = None
    """The observation field shown to the policy (default: its one text field, else every field as JSON)."""
    startup_timeout: float = Field(120.0, gt=0)
    """Seconds the server may take to answer ``/health`` (at the run's start, and before the first episode)."""
    message_timeout: float = Field(60.0, gt=0)
    """Seconds one ``reset`` or ``step`` may take."""

    @field_validator("env")
    @classmethod
    def _reference(cls, value: str | None) -> str | None:
        if value is not None:
            module, sep, attr = value.partition(":")
            if not (sep and module and attr):
                raise ValueError(f"expected 'package.module:attribute', got {value!r}")
        return value

    @field_validator("url")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname or parts.port is None:
                raise ValueError(f"expected http://host:port (or https, ws, wss), got {value!r}")
            if parts.path.strip("/") or parts.query:
                raise ValueError(f"expected the server's root, http://host:port, got {value!r}")
        return value.rstrip("/") if value is not None else None


def text_fields(schema: dict[str, Any]) -> list[str]:
    """The string fields of a JSON schema (``/schema``'s action or observation), OpenEnv's own ones left out."""
    props = schema.get("properties", {})
    return [k for k, v in props.items() if k not in _RESERVED and v.get("type") == "string"]


def _http_url(url: str) -> str:
    return "http" + url[2:] if url.startswith("ws") else url


def _served_object(obj: Any, *, field: str) -> None:
    """Refuse what ``env`` names unless it is an OpenEnv ``Environment`` subclass or an ASGI app."""
    from openenv.core.env_server import Environment

    if isinstance(obj, type) and issubclass(obj, Environment):
        from miles_envs.openenv.server import environment_types

        environment_types(obj, field=field)
        return
    if callable(obj) and not isinstance(obj, type):
        return  # an ASGI app (create_app's FastAPI)
    raise SettingsError(f"{field}: {obj!r} is neither an OpenEnv Environment subclass nor an app made by create_app")


class OpenEnvText:
    """One OpenEnv session as a :class:`~miles_envs.gym_text.episode.TextEnv` (synchronous, like OpenEnv's client)."""

    def __init__(
        self,
        url: str,
        *,
        action_field: str,
        observation_field: str | None,
        api_key: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        import inspect

        from openenv.core import GenericEnvClient
        from websockets.sync.client import connect

        options: dict[str, Any] = {"additional_headers": {"Authorization": f"Bearer {api_key}"} if api_key else {}}
        if "legacy" in inspect.signature(connect).parameters:  # websockets >= 17.1: a connection held open
            options["legacy"] = True

        class _Client(GenericEnvClient):  # (OpenEnv's client sends no headers: the run's key goes with its connect)
            def connect(self) -> _Client:
                if self._ws is None:  # type: ignore[has-type]
                    try:
                        self._ws = connect(self._ws_url, open_timeout=self._connect_timeout, **options)
                    except Exception as exc:
                        raise ConnectionError(f"cannot open an OpenEnv session at {self._ws_url}: {exc}") from exc
                return self

        self.client = _Client(base_url=url, message_timeout_s=timeout)
        self.action_field = action_field
        self.observation_field = observation_field

    def render(self, observation: dict[str, Any]) -> str:
        """The text the policy reads for ``observation``."""
        if self.observation_field is not None:
            return str(observation.get(self.observation_field, ""))
        return json.dumps(observation, ensure_ascii=False, sort_keys=True)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        result = self.client.reset(**({"seed": seed} if seed is not None else {}), **(options or {}))
        return self.render(result.observation), {"reward": result.reward, "done": result.done}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        result = self.client.step({self.action_field: action})
        return self.render(result.observation), float(result.reward or 0.0), bool(result.done), False, {}

    def close(self) -> None:
        self.client.close()


class OpenEnvRollout(TextEnvRollout[OpenEnvSettings]):
    """Episodes of an OpenEnv environment server (started by the run, or at ``url``) through the session server."""

    name: ClassVar[str] = "openenv"
    requires: ClassVar[tuple[Requirement, ...]] = (OPENENV, OPENAI)

    def __init__(self, settings: OpenEnvSettings) -> None:
        super().__init__(settings)
        self._fields: tuple[str, str | None] | None = None

    @classmethod
    def check_settings(cls, options: OpenEnvSettings, settings: MilesSettings | None) -> None:
        """Before anything starts: ``env`` or ``url`` set; ``env`` imports and is an environment or an app; a
        ``url`` given alone answers ``/health``. Each refusal names its field."""
        if options.env is None and options.url is None:
            raise SettingsError(
                "rollout.function.env: the openenv rollout function needs an environment to serve (env = "
                "'package.module:Environment') or the url of a running OpenEnv server (url = 'http://host:port')"
            )
        if options.env is not None:
            _served_object(load_object(options.env, field="rollout.function.env"), field="rollout.function.env")
        if options.url is not None and options.env is None:
            _wait_healthy(options.url, timeout=2.0, headers=_headers(options), field="rollout.function.url")

    def server(self) -> RewardServer | None:
        """The environment server the run starts for ``env`` (``None`` once ``url`` is set)."""
        s = self.settings
        if s.url is not None or s.env is None:
            return None
        return RewardServer(
            model_path=s.env,
            module="miles_envs.openenv.server",
            args=("--max-concurrent-envs", str(s.max_concurrent_envs)),
            device="cpu",
            startup_timeout=s.startup_timeout,
        )

    async def start(self, client: EngineClient, settings: RolloutSettings | None = None) -> None:
        """Start the session server, and learn the environment's action and observation fields (``/schema``)."""
        import asyncio

        await super().start(client, settings)
        if self._fields is None:
            self._fields = await asyncio.to_thread(self._schema_fields)

    def _schema_fields(self) -> tuple[str, str | None]:
        import httpx

        s = self.settings
        if s.url is None:
            raise SettingsError("rollout.function.url: no OpenEnv server (run through miles train, or set url)")
        _wait_healthy(s.url, timeout=s.startup_timeout, headers=_headers(s), field="rollout.function.url")
        answer = httpx.get(_http_url(s.url) + "/schema", headers=_headers(s), timeout=30.0, trust_env=False)
        answer.raise_for_status()
        schema = answer.json()
        actions = text_fields(schema.get("action", {}))
        action = s.action_field or (actions[0] if len(actions) == 1 else None)
        if action is None or action not in schema.get("action", {}).get("properties", {}):
            raise SettingsError(
                f"rollout.function.action_field: the environment's action fields are "
                f"{sorted(schema.get('action', {}).get('properties', {}))}, its text fields {actions}: name the one "
                "that receives the policy's reply"
            )
        observations = text_fields(schema.get("observation", {}))
        observation = s.observation_field or (observations[0] if len(observations) == 1 else None)
        log.info("OpenEnv server %s: the reply goes to action.%s, the policy reads %s", s.url, action,
                 f"observation.{observation}" if observation else "the observation as JSON")  # fmt: skip
        return action, observation

    def make_env(self, sample: Sample) -> OpenEnvText:
        assert self._fields is not None and self.settings.url is not None, "start() runs before the first episode"
        action, observation = self._fields
        s = self.settings
        key = _headers(s).get("Authorization", "").removeprefix("Bearer ") or None
        return OpenEnvText(s.url, action_field=action, observation_field=observation, api_key=key,  # type: ignore[arg-type]
                           timeout=s.message_timeout)  # fmt: skip


def _headers(settings: OpenEnvSettings) -> dict[str, str]:
    import os

    from miles.auth import ServiceKeys

    if settings.api_key_env is not None:
        key = os.environ.get(settings.api_key_env)
        return {"Authorization": f"Bearer {key}"} if key else {}
    return ServiceKeys.from_env().headers()


def _wait_healthy(url: str, *, timeout: float, headers: dict[str, str], field: str) -> None:
    """Until ``url``'s ``/health`` answers 200; a :class:`SettingsError` naming ``field`` after ``timeout``."""
    import httpx

    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            answer = httpx.get(_http_url(url) + "/health", headers=headers, timeout=5.0, trust_env=False)
            if answer.status_code == 200:
                return
            last = f"HTTP {answer.status_code}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise SettingsError(f"{field}: no OpenEnv server answers at {url} ({last})")
        time.sleep(0.25)
