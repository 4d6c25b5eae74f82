"""How the HTTP clients of the rollout side report an engine's or a router's refusal."""

from __future__ import annotations

import httpx

from miles.errors import EngineError

__all__ = ["EngineHTTPError", "response_message"]


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
