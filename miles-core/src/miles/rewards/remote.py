"""The ``remote`` reward: a reward model (or verifier) served over HTTP, called with async httpx.

Request: ``POST <url>`` with JSON ``{"prompt", "response", "label", "metadata"}`` (plus ``prompt_ids`` /
``response_ids`` when ``send_token_ids``). Response: a JSON number, or an object with ``reward`` (a
number) and optionally ``parts`` (``{name: number}``). Connection errors, timeouts, HTTP 429 and 5xx
are retried with exponential back-off; other HTTP errors and malformed bodies fail at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, Any

from pydantic import Field

from miles.components import ComponentSettings
from miles.rewards.base import Reward, RewardOutput
from miles.types import Sample

if TYPE_CHECKING:
    import httpx

__all__ = ["RemoteReward", "RemoteRewardError", "RemoteRewardSettings"]

logger = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """The reward server answered something unusable, or kept failing after the retries."""


class RemoteRewardSettings(ComponentSettings):
    """Settings of the ``remote`` reward."""

    url: str
    """Endpoint that scores one sample (``http://127.0.0.1:8000/score``)."""
    request_timeout: float = Field(10.0, gt=0.0)
    """Seconds one HTTP attempt may take (the whole call is also bounded by ``reward.timeout``)."""
    max_retries: int = Field(3, ge=0)
    """Extra attempts after a connection error, a timeout, HTTP 429 or 5xx."""
    backoff: float = Field(0.5, ge=0.0)
    """Seconds before the first retry; doubled after each."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Extra HTTP headers (e.g. ``Authorization``)."""
    send_token_ids: bool = False
    """Also send ``prompt_ids`` and ``response_ids``."""
    max_connections: int = Field(64, ge=1)
    """Connections in the client's pool."""


class RemoteReward(Reward[RemoteRewardSettings]):
    """A reward computed by an HTTP service (reward model, sandbox, judge)."""

    name = "remote"

    def __init__(self, settings: RemoteRewardSettings) -> None:
        super().__init__(settings)
        self._client: httpx.AsyncClient | None = None

    def _get_client(self) -> httpx.AsyncClient:
        import httpx

        s = self.settings
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(s.request_timeout),
                headers=s.headers,
                limits=httpx.Limits(max_connections=s.max_connections),
            )
        return self._client

    def payload(self, sample: Sample) -> dict[str, Any]:
        s = self.settings
        body: dict[str, Any] = {
            "prompt": sample.prompt,
            "response": sample.response,
            "label": sample.label,
            "metadata": sample.metadata,
        }
        if s.send_token_ids:
            body["prompt_ids"] = sample.prompt_ids
            body["response_ids"] = sample.response_ids
        return body

    async def score(self, sample: Sample) -> RewardOutput:
        import httpx

        s = self.settings
        client = self._get_client()
        body = self.payload(sample)
        delay = s.backoff
        last: str = ""
        for attempt in range(s.max_retries + 1):
            if attempt:
                await asyncio.sleep(delay)
                delay *= 2
            try:
                response = await client.post(s.url, json=body)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                last = f"{type(exc).__name__}: {exc}"
                logger.debug("remote reward %s attempt %d: %s", s.url, attempt + 1, last)
                continue
            if response.status_code == 429 or response.status_code >= 500:
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                logger.debug("remote reward %s attempt %d: %s", s.url, attempt + 1, last)
                continue
            if response.status_code != 200:
                raise RemoteRewardError(f"{s.url} answered HTTP {response.status_code}: {response.text[:200]}")
            return _parse(response, s.url)
        raise RemoteRewardError(f"{s.url} failed after {s.max_retries + 1} attempt(s); last error: {last}")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _parse(response: httpx.Response, url: str) -> RewardOutput:
    try:
        data = response.json()
    except ValueError:
        raise RemoteRewardError(f"{url} answered a body that is not JSON: {response.text[:200]!r}") from None
    parts: dict[str, float] = {}
    if isinstance(data, dict):
        if "reward" not in data:
            raise RemoteRewardError(f"{url} answered an object without 'reward': {str(data)[:200]}")
        raw_parts = data.get("parts") or {}
        if not isinstance(raw_parts, dict):
            raise RemoteRewardError(f"{url}: 'parts' must be an object, got {type(raw_parts).__name__}")
        parts = {str(k): _number(v, url, f"parts.{k}") for k, v in raw_parts.items()}
        data = data["reward"]
    return RewardOutput(_number(data, url, "reward"), parts)


def _number(value: Any, url: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise RemoteRewardError(f"{url}: {what} must be a finite number, got {value!r}")
    return float(value)
