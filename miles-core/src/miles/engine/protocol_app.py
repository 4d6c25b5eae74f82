"""The skeleton of an SGLang-protocol engine server: the routes every Miles engine answers the same way, over
its own scheduler's operations.

An engine supplies a :class:`ServedEngine` (what its scheduler does for each control call) and
:func:`create_protocol_app` builds the FastAPI application with SGLang's admin routes on it — ``/health``,
``/health_generate``, ``/model_info`` (``/get_model_info``), ``/server_info`` (``/get_server_info``),
``/get_weight_version``, ``/abort_request``, ``/pause_generation``, ``/continue_generation``, ``/flush_cache``
(GET and POST), ``/update_weights_from_disk``, ``/update_weight_version`` — plus Miles' ``/weights_checksum``
and, with ``enable_debug_endpoints`` in the server's arguments, ``/debug/randomize_weights``; and the
``Authorization: Bearer`` check of an engine's API key. The engine then adds its ``/generate`` and lets the
plugins add theirs (:meth:`miles.plugins.PluginManager.add_engine_routes`). The local engine
(:mod:`miles.engine.server`) and miles-diffusion's image engine are built this way.

Control errors are SGLang's ``{"success": false, "message"}`` with HTTP 400 (:func:`miles.engine.responses.admin`).

A declared public module of the local engine (see :mod:`miles.engine`).
"""

from __future__ import annotations

import logging
import typing
from abc import ABC, abstractmethod
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from miles.auth import ServiceKeys, install_auth
from miles.engine.responses import RequestError, admin
from miles.rollout.protocol import INSTANCE_HEADER
from miles.types import PauseMode

__all__ = ["ServedEngine", "create_protocol_app"]

log = logging.getLogger(__name__)

_PAUSE_MODES: tuple[str, ...] = typing.get_args(PauseMode)


class ServedEngine(ABC):
    """An engine as the protocol's shared routes see it: its scheduler's operations.

    The coroutines run on the server's event loop; an engine runs model work on its own worker (the local
    engine's scheduler thread) and awaits it. A ``ValueError``, ``OSError`` or ``RuntimeError`` they raise
    answers the control call with SGLang's error shape, naming it.
    """

    api_key: str | None = None
    """The key every request but ``/health`` must bear (``Authorization: Bearer <key>``; with
    :attr:`admin_api_key`, only the generation routes); ``None``: none (:mod:`miles.auth`)."""
    admin_api_key: str | None = None
    """The key of the control routes (weights, pause, memory, flush, abort, debug ...), which the API key then
    no longer opens, as SGLang's ``--admin-api-key``; ``None``: none."""
    instance: str | None = None
    """This process's identity, sent with every ``/health`` answer (the ``x-miles-instance`` header)."""
    server_args: dict[str, Any]
    """The server's arguments (``/server_info`` reports them; ``enable_debug_endpoints`` adds the debug route)."""

    @property
    @abstractmethod
    def weight_version(self) -> str:
        """The weight version served now."""

    @abstractmethod
    async def generation_healthy(self) -> bool:
        """``/health_generate``: whether the engine can generate (a paused engine counts as healthy)."""

    @abstractmethod
    def model_info(self) -> dict[str, Any]:
        """``/model_info``: the served model (``model_path``, ``is_generation``, ``weight_version`` ...)."""

    @abstractmethod
    async def server_info(self) -> dict[str, Any]:
        """``/server_info``: the server's arguments, statistics, version and weight version."""

    @abstractmethod
    async def abort(self, rid: str | None, message: str) -> int:
        """Abort request ``rid`` (and its ``n`` children), or every request if ``None``; returns how many."""

    @abstractmethod
    async def pause(self, mode: PauseMode) -> None:
        """Stop generating: ``abort`` every request, ``retract`` the running ones, or hold them ``in_place``."""

    @abstractmethod
    async def resume(self) -> None:
        """Generate again after :meth:`pause`."""

    @abstractmethod
    async def flush_cache(self) -> str:
        """Empty the prefix cache; returns the answer's message."""

    @abstractmethod
    async def load_weights_from_disk(
        self, path: str, *, version: str | None, flush_cache: bool, abort_all_requests: bool
    ) -> tuple[str, str]:
        """``/update_weights_from_disk``: load the safetensors directory ``path``; returns the answer's
        message and the weight version served afterwards.

        :param version: the new weight version (``None``: the engine's rule).
        """

    @abstractmethod
    async def set_weight_version(self, version: str, *, abort_all_requests: bool) -> None:
        """``/update_weight_version``: serve the current weights under ``version``."""

    @abstractmethod
    async def weights_checksum(self) -> dict[str, Any]:
        """``/weights_checksum``: ``checksums`` per parameter, tied ``aliases`` and the served ``dtype``."""

    @abstractmethod
    async def randomize_weights(self, seed: int) -> int:
        """``/debug/randomize_weights``: overwrite every weight with random values; returns how many tensors."""


def create_protocol_app(engine: ServedEngine, *, title: str, check_api_key: bool = True) -> FastAPI:
    """The FastAPI application with the shared routes over ``engine`` (the module docstring lists them).

    :param title: the application's title in its OpenAPI document.
    :param check_api_key: refuse every request but ``/health`` without its key (HTTP 401): the admin key on
        the control routes when the engine has one, else the API key (:func:`miles.auth.install_auth`; a no-op
        while the engine has no key).
    """
    app = FastAPI(title=title)

    if check_api_key:
        install_auth(app, ServiceKeys(engine.api_key, engine.admin_api_key))

    @app.get("/health")
    async def health() -> Response:
        headers = {INSTANCE_HEADER: engine.instance} if engine.instance is not None else None
        return Response(status_code=200, headers=headers)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return Response(status_code=200 if await engine.generation_healthy() else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return await engine.server_info()

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine.weight_version}

    @app.post("/abort_request")
    async def abort_request(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            rid = body.get("rid")
            target = None if body.get("abort_all") or rid in (None, "") else str(rid)
            return {"success": True, "num_aborted": await engine.abort(target, "aborted by /abort_request")}

        return await admin(request, run)

    @app.post("/pause_generation")
    async def pause_generation(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            mode = body.get("mode", "abort")
            if mode not in _PAUSE_MODES:
                raise RequestError(f"mode must be one of {', '.join(_PAUSE_MODES)}, got {mode!r}")
            await engine.pause(mode)
            return {"success": True, "message": f"generation paused (mode {mode})"}

        return await admin(request, run)

    @app.post("/continue_generation")
    async def continue_generation(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            await engine.resume()
            return {"success": True, "message": "generation continued"}

        return await admin(request, run)

    @app.get("/flush_cache", operation_id="flush_cache_get")
    @app.post("/flush_cache", operation_id="flush_cache_post")
    async def flush_cache() -> Any:
        return {"success": True, "message": await engine.flush_cache()}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise RequestError("model_path (a safetensors directory) is required")
            version = body.get("weight_version")
            message, served = await engine.load_weights_from_disk(
                path,
                version=None if version is None else str(version),
                flush_cache=bool(body.get("flush_cache", True)),
                abort_all_requests=bool(body.get("abort_all_requests", False)),
            )
            return {"success": True, "message": message, "weight_version": served}

        return await admin(request, run)

    @app.post("/update_weight_version")
    async def update_weight_version(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            version = body.get("new_version", body.get("weight_version"))
            if version is None:
                raise RequestError("new_version is required")
            await engine.set_weight_version(str(version), abort_all_requests=bool(body.get("abort_all_requests")))
            return {"success": True, "message": "weight version updated", "new_version": str(version)}

        return await admin(request, run)

    @app.post("/weights_checksum")
    async def checksum(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            report = await engine.weights_checksum()
            return {"success": True, "weight_version": engine.weight_version, **report}

        return await admin(request, run)

    if engine.server_args.get("enable_debug_endpoints"):

        @app.post("/debug/randomize_weights")
        async def randomize(request: HTTPRequest) -> Any:
            async def run(body: dict[str, Any]) -> Any:
                count = await engine.randomize_weights(int(body.get("seed", 0)))
                log.warning("debug: overwrote %d parameters with random values", count)
                return {"success": True, "num_tensors": count}

            return await admin(request, run)

    return app
