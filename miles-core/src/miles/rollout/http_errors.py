"""How the HTTP clients of the rollout side report an engine's or a router's refusal."""

from __future__ import annotations

import httpx

from miles.errors import EngineError

__all__ = ["EngineHTTPError", "response_message", "transport_message"]


class EngineHTTPError(EngineError):
    """An engine (or router) answered HTTP >= 400 (``status``); the message holds its own message."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def response_message(resp: httpx.Response) -> str:
    """The message of an error answer: SGLang's ``{"error": {"message"}}`` or ``{"success": false, "message"}``,
    FastAPI's ``{"detail"}``, else the start of the body."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(body)[:500]


def transport_message(exc: BaseException) -> str:
    """``Type: message`` of a request that got no answer, with the operating system's error beneath it where
    httpx's message hides it: ``ConnectError: All connection attempts failed ([Errno 111] Connect call failed
    ('127.0.0.1', 30000))`` -- refused (nothing listens), unreachable, too many open files... tell different
    stories."""
    text = f"{type(exc).__name__}: {exc or 'no answer'}"
    cause: BaseException | None = exc
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno is not None:
            return text if str(cause) in text else f"{text} ({cause})"
        cause = cause.__cause__ or cause.__context__
    return text
