"""The error bodies and JSON body parsing of SGLang's native HTTP protocol, for every engine that speaks it
(the local engine, the diffusion image engine, a third party's).

SGLang answers a bad ``/generate`` with ``{"error": {"message", "code"}}`` and a refused control call with
``{"success": false, "message"}``; an empty body is an empty object.

A declared public module of the local engine (see :mod:`miles.engine`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from miles.engine.parsing import RequestError

__all__ = ["Admin", "RequestError", "admin", "admin_error", "generate_error", "json_body"]

Admin = Callable[[HTTPRequest, Callable[[dict[str, Any]], Awaitable[Any]]], Awaitable[Any]]
"""The type of :func:`admin`: what route groups receive to answer a control call in SGLang's shape."""


def generate_error(message: str, status: int = 400) -> JSONResponse:
    """The error of a generation route (``/generate`` and its kin)."""
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def admin_error(message: str, status: int = 400) -> JSONResponse:
    """The error of a control route (pause, weights, cache)."""
    return JSONResponse({"success": False, "message": message}, status_code=status)


async def json_body(request: HTTPRequest) -> Any:
    """The request's JSON body (``{}`` when empty); malformed JSON raises :class:`RequestError`."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"malformed JSON body: {exc}") from None


async def admin(request: HTTPRequest, handler: Callable[[dict[str, Any]], Awaitable[Any]]) -> Any:
    """Run a control route's ``handler`` on the request's JSON object; a bad body or a failure the handler
    raises (``ValueError``, ``OSError`` ...) is answered with :func:`admin_error` naming it."""
    try:
        body = await json_body(request)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return await handler(body)
    except (RequestError, ValueError, TypeError, OSError, RuntimeError) as exc:
        return admin_error(str(exc))
