"""A small HTTP client of the session server: open a session, read its samples, close it."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import httpx

from miles.errors import MilesError
from miles.sessions.session import SessionSampling
from miles.types import Sample

__all__ = ["SessionClient", "SessionServerError"]


class SessionServerError(MilesError):
    """The session server answered an error (its message included)."""


class SessionClient:
    """Talks to ``miles sessions serve`` (or an embedded server) at ``url``."""

    def __init__(self, url: str, *, timeout: float = 600.0, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        """The key sent with every request (the session server's; ``None``: none)."""
        self._http = httpx.AsyncClient(
            timeout=timeout, headers={"Authorization": f"Bearer {api_key}"} if api_key else {}
        )

    def base_url(self, session_id: str) -> str:
        """The OpenAI ``base_url`` of a session: point any OpenAI-compatible client at it."""
        return f"{self.url}/sessions/{session_id}/v1"

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        resp = await self._http.request(method, self.url + path, json=body)
        if resp.status_code >= 400:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text[:500]
            raise SessionServerError(f"{method} {path}: HTTP {resp.status_code}: {message}")
        return resp.json()

    async def create(
        self,
        *,
        sampling: SessionSampling | None = None,
        routing_key: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> str:
        body: dict[str, Any] = {"metadata": metadata or {}}
        if routing_key is not None:
            body["routing_key"] = routing_key
        if sampling is not None:
            body["sampling"] = asdict(sampling)
        return str((await self._call("POST", "/sessions", body))["id"])

    async def samples(self, session_id: str) -> list[Sample]:
        """The session's trajectories, the latest last."""
        return [Sample.from_dict(d) for d in await self._call("GET", f"/sessions/{session_id}/samples")]

    async def delete(self, session_id: str) -> None:
        await self._call("DELETE", f"/sessions/{session_id}")

    async def close(self) -> None:
        await self._http.aclose()
