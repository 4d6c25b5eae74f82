"""The router in front of the engines: ``rollout.router = "smg"`` (the SGLang Model Gateway, ``pip install smg``).

Miles does not route generation itself when a router is configured: ``smg`` receives every ``/generate``
with the request's routing key (a sample group, a multi-turn session) in a header and, with the default
``manual`` policy, pins each key to one engine — chosen by load at the key's first request — so a group's
samples and a session's turns share that engine's prefix cache. ``smg`` health-checks the engines and
fails a key over to a healthy engine when its engine dies. Control calls (pause, weights, memory, flush,
version, checksums) never go through it: the engine client sends them to every engine directly.

This module builds the ``smg launch`` command, waits until the router reports every engine healthy and
registered, and describes the launched fleet (:class:`EngineFleet`) for the processes that talk to it.
Starting and reaping the process is the launcher's job (``start_process``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.auth import ServiceKeys
from miles.errors import LaunchError, SettingsError

if TYPE_CHECKING:
    from miles.rollout.http_client import HttpEngineClient
    from miles.settings.model import RouterSettings

__all__ = [
    "FLEET_FILE",
    "EngineFleet",
    "flush_caches",
    "smg_argv",
    "smg_command",
    "smg_executable",
    "smg_key_flags",
    "wait_for_router",
]

log = logging.getLogger(__name__)


def smg_executable() -> str:
    """The ``smg`` command (next to this interpreter first, then on ``PATH``)."""
    beside = Path(sys.executable).with_name("smg")
    if beside.exists():
        return str(beside)
    found = shutil.which("smg")
    if found is None:
        raise SettingsError(
            "rollout.router: 'smg' is selected but the smg command is not installed "
            "(pip install smg; it conflicts with sglang-router, which claims the same command)"
        )
    return found


def smg_argv(
    settings: RouterSettings, worker_urls: Sequence[str], *, host: str, port: int, prometheus_port: int
) -> list[str]:
    """``smg launch`` for ``worker_urls`` (registered at start-up), listening on ``host:port`` (its Prometheus
    metrics on ``127.0.0.1:prometheus_port``); the run's keys are added by :func:`smg_command`.

    ``manual`` pins each routing key (placing new keys by ``assignment_mode``); ``consistent_hashing``
    hashes it; ``cache_aware`` places by prefix overlap and, through smg's routing-key override, keeps a
    key on the engine its first request went to; the other policies ignore the key (load-balancing
    baselines).
    """
    if not worker_urls:
        raise SettingsError("rollout.router: a router needs at least one engine (cluster.num_engines >= 1)")
    argv = [
        smg_executable(), "launch",
        "--host", host, "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", settings.policy,
        "--routing-key-headers", settings.routing_key_header,
        "--health-check-endpoint", "/health",
        "--health-check-interval-secs", str(settings.health_check_interval),
        # its metrics answer without a key: on this host's loopback only, whatever ``host`` is
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
        "--disable-tokenizer-autoload",  # requests carry token ids; never look for a tokenizer on a hub
        "--shutdown-grace-period-secs", "0",
        "--log-level", "warn",
    ]  # fmt: skip
    if settings.policy == "manual":
        argv += ["--assignment-mode", settings.assignment_mode]
    elif settings.policy == "cache_aware":
        argv += ["--routing-key-override"]
    return argv + list(settings.extra_args)


def smg_key_flags(keys: ServiceKeys) -> list[str]:
    """smg's flags for the run's keys: ``--api-key`` (checked on the data plane, ``/generate`` ..., and sent to
    the engines), and with an admin key a control-plane key of role ``admin`` (``/workers``, ``/flush_cache``
    ... then need it, and the API key no longer opens them)."""
    flags = [f"--api-key={keys.api_key}"] if keys.api_key else []  # one argument: a key may start with "-"
    if keys.admin_api_key:
        flags += [f"--control-plane-api-keys=miles:miles:admin:{keys.admin_api_key}"]
    return flags


def smg_command(argv: Sequence[str], keys: ServiceKeys) -> list[str]:
    """The command that runs ``argv`` (from :func:`smg_argv`) with the run's keys.

    When smg's Python package is importable here, ``python -m miles.rollout.smg_main``: it reads the keys
    from the environment of the process (:data:`~miles.auth.API_KEY_ENV` ...), so they never appear on a
    command line. Otherwise the keys go on smg's command line (visible in the host's process list; said once
    in the log)."""
    import importlib.util

    if not keys.enabled:
        return list(argv)
    if importlib.util.find_spec("smg") is not None:
        return [sys.executable, "-m", "miles.rollout.smg_main", *argv[1:]]
    log.warning("smg's package is not importable by %s: the run's key goes on smg's command line", sys.executable)
    return [*argv, *smg_key_flags(keys)]


def wait_for_router(
    url: str,
    worker_urls: Sequence[str],
    *,
    timeout: float,
    exited: Callable[[], str | None] = lambda: None,
    poll_interval: float = 0.2,
    headers: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Poll ``/readiness`` until the router reports every engine healthy, then check ``/workers`` lists
    exactly ``worker_urls``; return smg's worker records.

    :param exited: ``None`` while the router process runs, else why it stopped (its log tail).
    :param headers: sent with every request (the run's key: ``/workers`` needs it).
    :raises LaunchError: the router exited, did not get ready within ``timeout``, or registered other
        workers than asked.
    """
    import httpx

    from miles.rollout.http_errors import transport_message

    deadline = time.monotonic() + timeout
    last = "no answer"
    with httpx.Client(timeout=5.0, trust_env=False, headers=headers or {}) as client:
        while True:
            why = exited()
            if why is not None:
                raise LaunchError(f"the router exited before it was ready: {why}", process="router")
            try:
                ready = client.get(url + "/readiness")
                body = ready.json() if ready.content else {}
                if ready.status_code == 200 and int(body.get("healthy_workers", 0)) >= len(worker_urls):
                    break
                last = f"HTTP {ready.status_code}: {body}"
            except (httpx.TransportError, ValueError) as exc:
                last = transport_message(exc)
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"the router at {url} did not report {len(worker_urls)} healthy engines within {timeout:g} s "
                    f"(last answer: {last})",
                    process="router",
                )
            time.sleep(poll_interval)
        workers: list[dict[str, Any]] = client.get(url + "/workers").json().get("workers", [])
    registered = sorted(str(w.get("url", "")).rstrip("/") for w in workers)
    if registered != sorted(u.rstrip("/") for u in worker_urls):
        raise LaunchError(f"the router at {url} registered {registered}, expected {sorted(worker_urls)}")
    return workers


FLEET_FILE = "fleet.json"
"""Where in the run directory the launching host announces the fleet, once every engine and the router answer."""


@dataclass
class EngineFleet:
    """The engines of a run and the router in front of them (what ``fleet.json`` records)."""

    engine_urls: list[str]
    """Base URLs of the engines: control calls go to each."""
    router_url: str | None = None
    """Base URL of the router generation goes through (``None``: the client routes itself)."""
    routing_key_header: str = "x-session-id"
    """Header carrying a request's routing key to the router."""
    client_options: dict[str, Any] = field(default_factory=dict)
    """More :class:`~miles.rollout.http_client.HttpEngineClient` keyword arguments."""
    joining: list[str] = field(default_factory=list)
    """Engines added while the run goes on (``miles fleet add``) that do not serve yet: trainer rank 0 adds
    them to its client (:mod:`miles.driver.fleet`); they join :attr:`engine_urls` once they serve."""
    draining: list[str] = field(default_factory=list)
    """Engines of :attr:`engine_urls` leaving the fleet (``miles fleet remove``): no new requests go to them."""
    keys: ServiceKeys | None = field(default=None, repr=False, compare=False)
    """The run's keys, which clients send (never written by :meth:`announce`; ``None``: the environment's)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "engine_urls": list(self.engine_urls),
            "router_url": self.router_url,
            "routing_key_header": self.routing_key_header,
            "joining": list(self.joining),
            "draining": list(self.draining),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineFleet:
        return cls(
            engine_urls=list(data.get("engine_urls", [])),
            router_url=data.get("router_url"),
            routing_key_header=str(data.get("routing_key_header") or "x-session-id"),
            joining=list(data.get("joining", [])),
            draining=list(data.get("draining", [])),
        )

    def announce(self, path: Path) -> None:
        """Write the fleet to ``path`` at once (a reader never sees half of it)."""
        scratch = path.with_name(path.name + ".tmp")
        scratch.write_text(json.dumps(self.to_json()))
        os.replace(scratch, path)

    @classmethod
    async def announced(cls, path: Path, *, timeout: float, poll_interval: float = 0.1) -> EngineFleet:
        """The fleet :meth:`announce` writes to ``path``, once it is there (trainer rank 0 loads its model
        meanwhile). Raises :class:`~miles.errors.LaunchError` after ``timeout`` seconds."""
        import asyncio

        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() >= deadline:
                raise LaunchError(f"no engines were announced in {path} within {timeout:g} s")
            await asyncio.sleep(poll_interval)
        return cls.from_json(json.loads(path.read_text()))

    def client(self, **options: Any) -> HttpEngineClient:
        """An engine client over this fleet (generation through the router when there is one), sending the
        run's keys (:data:`~miles.auth.API_KEY_ENV`, :data:`~miles.auth.ADMIN_API_KEY_ENV`)."""
        from miles.rollout.http_client import HttpEngineClient

        keys = self.keys if self.keys is not None else ServiceKeys.from_env()
        return HttpEngineClient(
            self.engine_urls,
            router_url=self.router_url,
            routing_key_header=self.routing_key_header,
            **{"api_key": keys.api_key, "admin_api_key": keys.admin_api_key, **self.client_options, **options},
        )


def flush_caches(urls: Sequence[str], keys: ServiceKeys) -> None:
    """Empty each engine's prefix cache once it is up (its health check generated a token): a control route,
    sent with the run's admin key (or its API key). Raises :class:`~miles.errors.LaunchError` naming the engine
    that refused."""
    import httpx

    with httpx.Client(timeout=60.0, trust_env=False, headers=keys.headers(control=True)) as client:
        for url in urls:
            resp = client.post(url.rstrip("/") + "/flush_cache")
            if resp.status_code >= 400:
                raise LaunchError(f"{url}/flush_cache: HTTP {resp.status_code}: {resp.text[:300]}")
