"""The run's secrets: the API key that every service of a run checks once it listens beyond loopback, and the
optional admin key of the control routes (SGLang's ``--api-key`` / ``--admin-api-key``).

- **Loopback needs no key.** A service on ``127.0.0.0/8`` (or ``::1``) is reached from this host only; one asked
  to bind any other address without a key refuses to start, naming the setting (:func:`check_bind`).
- **The key travels in the environment** (:data:`API_KEY_ENV`, :data:`ADMIN_API_KEY_ENV`), never on a
  command line (``/proc/*/cmdline`` and logs show those), never in ``settings.json``, logs or metrics.
  ``miles train`` makes one per run when a service of the run leaves loopback and none was given
  (``cluster.api_key`` or :data:`API_KEY_ENV`).
- **Two levels, as in SGLang 0.5.23** (``sglang/srt/utils/auth.py``): with only an API key every route needs
  it; with an admin key too, the control routes (weights, pause, memory, flush, abort, LoRA, debug ...)
  need the admin key and the others the API key — neither key opens the other's routes. ``/health`` (an
  empty liveness answer) is open, as SGLang leaves its probes open: the ``smg`` router registers a worker by
  probing it without a key.

Cheap to import: FastAPI / Starlette are imported only by :func:`install_auth`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from miles.errors import SettingsError

__all__ = [
    "ADMIN_API_KEY_ENV",
    "API_KEY_ENV",
    "GENERATION_ROUTES",
    "OPEN_ROUTES",
    "SECRET_FIELDS",
    "SECRET_FLAGS",
    "ServiceKeys",
    "check_bind",
    "install_auth",
    "is_control_route",
    "is_loopback",
    "new_key",
    "redact_argv",
]

API_KEY_ENV = "MILES_API_KEY"
"""The environment variable holding the run's API key (what ``cluster.api_key`` sets)."""
ADMIN_API_KEY_ENV = "MILES_ADMIN_API_KEY"
"""The environment variable holding the run's admin key of the control routes (``cluster.admin_api_key``)."""

OPEN_ROUTES = frozenset({"/health"})
"""Routes of an engine answered without a key: a liveness probe with an empty body (SGLang leaves ``/health*``,
``/ready`` and ``/metrics`` open; smg 1.13 probes ``/health`` without a key before it registers a worker)."""

GENERATION_ROUTES = frozenset(
    {
        "/generate",
        "/health_generate",
        "/model_info",
        "/get_model_info",
        "/server_info",
        "/get_server_info",
        "/get_weight_version",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
    }
)
"""Routes of an engine that the API key opens (SGLang's ``NORMAL`` level); every other route is a control route
(SGLang's ``ADMIN_OPTIONAL``: weights, pause, memory, flush, abort, LoRA, checksums, p2p, debug), so a route a
plugin adds is a control route unless listed here."""


def is_control_route(path: str) -> bool:
    """Whether ``path`` (``/update_weights_from_disk``, ``/generate`` ...) is a control route of an engine."""
    return path not in GENERATION_ROUTES and path not in OPEN_ROUTES


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``); ``0.0.0.0``, ``::`` and
    every routable address are not."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: whatever it resolves to, it is not known to be loopback
        return False


def new_key() -> str:
    """A fresh random key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class ServiceKeys:
    """The keys one service checks or one client sends (``None``: no such key). Never shown by ``repr``."""

    api_key: str | None = field(default=None, repr=False)
    """Opens every route (only the generation routes when :attr:`admin_api_key` is set)."""
    admin_api_key: str | None = field(default=None, repr=False)
    """Opens the control routes, and only them."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServiceKeys:
        """The keys in :data:`API_KEY_ENV` / :data:`ADMIN_API_KEY_ENV` (of ``environ``, default this process's)."""
        env = os.environ if environ is None else environ
        return cls(env.get(API_KEY_ENV) or None, env.get(ADMIN_API_KEY_ENV) or None)

    @classmethod
    def of_cluster(cls, cluster: Any, environ: Mapping[str, str] | None = None) -> ServiceKeys:
        """The run's keys: ``cluster.api_key`` / ``cluster.admin_api_key`` where set, else the environment's."""
        env = cls.from_env(environ)

        def value(secret: Any, fallback: str | None) -> str | None:
            return secret.get_secret_value() or None if secret is not None else fallback

        return cls(
            value(getattr(cluster, "api_key", None), env.api_key),
            value(getattr(cluster, "admin_api_key", None), env.admin_api_key),
        )

    @property
    def enabled(self) -> bool:
        """Whether any key is set (a service then checks requests)."""
        return bool(self.api_key or self.admin_api_key)

    def with_api_key(self, key: str) -> ServiceKeys:
        return replace(self, api_key=key)

    def env(self) -> dict[str, str]:
        """The environment variables that hand these keys to a child process."""
        out = {}
        if self.api_key:
            out[API_KEY_ENV] = self.api_key
        if self.admin_api_key:
            out[ADMIN_API_KEY_ENV] = self.admin_api_key
        return out

    def client_only(self) -> ServiceKeys:
        """The keys for a process that generates and nothing else (an agent, the session server's users)."""
        return ServiceKeys(self.api_key, None)

    def key_for(self, *, control: bool) -> str | None:
        """The key a client sends on a control route (``control``) or a generation route."""
        return (self.admin_api_key or self.api_key) if control else self.api_key

    def headers(self, *, control: bool = False) -> dict[str, str]:
        """``Authorization: Bearer`` for a request to a control route (``control``) or a generation route."""
        key = self.key_for(control=control)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def headers_for(self, path: str) -> dict[str, str]:
        """:meth:`headers` for a request to ``path`` of an engine."""
        return self.headers(control=is_control_route(path))

    def secrets(self) -> list[str]:
        """The key values (to redact them from text)."""
        return [k for k in (self.api_key, self.admin_api_key) if k]

    def allows(self, header: str | None, *, control: bool) -> bool:
        """Whether ``Authorization`` header ``header`` opens a route (SGLang's decision, constant-time)."""
        if control and self.admin_api_key:
            return _bearer(header, self.admin_api_key)
        if self.api_key:
            return _bearer(header, self.api_key)
        return True


SECRET_FIELDS = frozenset({"api_key", "admin_api_key"})
"""Option names of a server whose values are keys: never on a command line, never in ``/server_info``."""

SECRET_FLAGS = ("--api-key", "--admin-api-key", "--control-plane-api-keys")
"""Command-line flags whose value is a key (SGLang's, smg's, ``miles serve``'s)."""


def redact_argv(argv: list[str]) -> list[str]:
    """``argv`` with the value of every :data:`SECRET_FLAGS` flag replaced (for logs: a key that had to go on a
    command line is still never written)."""
    out: list[str] = []
    hide = False
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        if hide and not arg.startswith("--"):
            out.append("<redacted>")
            continue
        hide = arg in SECRET_FLAGS
        out.append(f"{flag}=<redacted>" if eq and flag in SECRET_FLAGS else arg)
    return out


def _bearer(header: str | None, key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def check_bind(host: str, keys: ServiceKeys, *, service: str, setting: str) -> None:
    """Refuse to serve on ``host`` beyond loopback without an API key.

    :param service: what refuses (``miles serve``, ``the session server`` ...).
    :param setting: where the key is set (``--api-key``, ``cluster.api_key`` ...), named in the error.
    :raises SettingsError: ``host`` is not loopback and ``keys`` has no API key.
    """
    if keys.api_key or is_loopback(host):
        return
    raise SettingsError(
        f"{setting}: {service} would listen on {host}, beyond loopback, without an API key: anyone who reaches "
        f"it could generate, pause the engines or load weights. Set {setting} (or the environment variable "
        f"{API_KEY_ENV}), or listen on 127.0.0.1"
    )


def install_auth(
    app: Any,
    keys: ServiceKeys,
    *,
    control: Callable[[str], bool] = is_control_route,
    open_routes: frozenset[str] = OPEN_ROUTES,
    error: Callable[[str], dict[str, Any]] | None = None,
) -> None:
    """Check ``Authorization: Bearer`` on every request to the ASGI ``app`` (FastAPI) with ``keys`` (nothing
    with no key): 401 with a JSON error otherwise. A pure ASGI middleware, so a streamed answer still sees its
    client go away.

    :param control: whether a path is a control route (the admin key opens it when one is set).
    :param open_routes: paths answered without a key.
    :param error: the JSON body of a 401 for a message (default SGLang's generation-error shape).
    """
    if not keys.enabled:
        return
    body_of = error or (lambda message: {"error": {"message": message, "code": 401}})

    class _Auth:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope.get("method") == "OPTIONS" or scope["path"] in open_routes:
                await self.inner(scope, receive, send)
                return
            header = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"), None)
            wanted_control = control(scope["path"])
            if keys.allows(header, control=wanted_control):
                await self.inner(scope, receive, send)
                return
            which = "the admin key" if wanted_control and keys.admin_api_key else "the API key"
            payload = json.dumps(
                body_of(f"missing or wrong key: this route needs {which} (Authorization: Bearer <key>)")
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                }
            )
            await send({"type": "http.response.body", "body": payload.encode()})

    app.add_middleware(_Auth)
