"""The session server: OpenAI's chat API per session, the exact token record behind it (FastAPI).

Routes (all JSON; errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``):

- ``POST /sessions`` → ``{"id"}``; optional body ``{"metadata", "routing_key", "sampling": {...}}``;
- ``POST /sessions/{id}/v1/chat/completions`` — OpenAI's chat completions (``base_url`` of an OpenAI
  client: ``http://HOST:PORT/sessions/{id}/v1``); ``GET /sessions/{id}/v1/models``;
- ``GET /sessions/{id}`` (counters), ``GET /sessions/{id}/samples`` (one :meth:`Sample.to_dict` per
  trajectory, the latest last), ``DELETE /sessions/{id}``;
- ``GET /health`` (503 until the live check passed), ``GET /info`` (template, parsers, the append-only and
  live checks).

A malformed request is a 400 naming the field, an unknown session a 404, a request the template cannot
extend append-only a 409, an engine failure a 502, an aborted generation a 503; a session that reaches
the context length gets a completion with ``finish_reason = "length"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from miles.auth import ServiceKeys, check_bind, install_auth
from miles.errors import SettingsError
from miles.net import bind_socket
from miles.sessions.routes import create_app
from miles.sessions.service import SessionService, TemplateNotAppendOnly

if TYPE_CHECKING:
    from fastapi import FastAPI

    from miles.rollout.client import EngineClient
    from miles.sessions.images import SessionVision
    from miles.sessions.live_check import LiveCheckReport
    from miles.settings.sessions import SessionSettings

__all__ = ["SessionServer", "TemplateNotAppendOnly"]

log = logging.getLogger(__name__)


def _unauthorized(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


class _EmbeddedUvicorn:
    """uvicorn in the caller's event loop, leaving the process's signal handlers alone."""

    def __init__(self, app: FastAPI, sock: socket.socket) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        # agents keep connections open between turns (a tool may run for minutes): never close them idle
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=3600)
        self.server = Server(config)
        self.sock = sock
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the session server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.sock.close()


class SessionServer(SessionService):
    """Sessions over a set of engines, served over HTTP (see the module docstring).

    :param client: the engines (generation goes through :meth:`EngineClient.generate`).
    :param tokenizer: the policy's tokenizer.
    :param context_length: the engines' context length (``settings.context_length`` wins).
    :param vision: a vision-language policy's image processor and placeholder token (see
        :class:`~miles.sessions.service.SessionService`).
    :param api_key: the key every request must carry (``Authorization: Bearer``; what an OpenAI client sends
        as its ``api_key``); default the run's, :data:`~miles.auth.API_KEY_ENV`. Needed to listen beyond
        loopback.
    :raises TemplateNotAppendOnly: the chat template fails the CPU render check.
    """

    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        settings: SessionSettings | None = None,
        *,
        context_length: int | None = None,
        api_key: str | None = None,
        vision: SessionVision | None = None,
    ) -> None:
        super().__init__(client, tokenizer, settings, context_length=context_length, vision=vision)
        self.ready = False
        self.live: LiveCheckReport | None = None
        self.keys = ServiceKeys(api_key or ServiceKeys.from_env().api_key)
        self.app = create_app(self)
        install_auth(self.app, self.keys, control=lambda path: False, open_routes=frozenset(), error=_unauthorized)
        self._http: _EmbeddedUvicorn | None = None
        self.url: str | None = None

    # -- serving -----------------------------------------------------------------------------------
    async def start(self) -> str:
        """Listen on ``settings.host:port`` in this event loop; run the live check; return the URL.

        :raises SettingsError: ``rollout.sessions.host`` is beyond loopback and there is no API key."""
        check_bind(self.settings.host, self.keys, service="the session server", setting="cluster.api_key")
        self.ready = False
        sock = bind_socket(self.settings.host, self.settings.port)
        self._http = _EmbeddedUvicorn(self.app, sock)
        await self._http.start()
        self.url = f"http://{self.settings.host}:{sock.getsockname()[1]}"
        if self.settings.live_check:
            from miles.sessions.live_check import live_check

            self.live = await live_check(self, tolerance=self.settings.live_check_tolerance)
            self.live_status = {"ok": self.live.ok, "summary": self.live.summary()}
            log.info("%s", self.live.summary())
            if not self.live.ok:
                await self.stop()
                raise SettingsError(f"rollout.sessions.live_check: {self.live.summary()}")
        self.ready = True
        log.info("session server on %s (%s)", self.url, self.renderer.name)
        return self.url

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.stop()
            self._http = None
