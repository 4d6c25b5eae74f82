"""What the engine client needs of the router (smg): its list of engines (``/workers``), the header that names
the engine that served a request and the routing keys it accepts.

The list: an engine that joins a run behind smg is registered once it has the weights (``POST /workers``, with the
run's API key, which smg then sends the engine); one that leaves is removed (``DELETE /workers/{id}``: smg
drains it first, letting its requests finish). Both are control routes of smg, sent with the run's admin key
(or its API key when there is no admin key).
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import TYPE_CHECKING, Any

from miles.rollout.http_errors import EngineHTTPError, response_message

if TYPE_CHECKING:
    import httpx

    from miles.auth import ServiceKeys

__all__ = ["ROUTED_WORKER_HEADER", "SmgWorkers", "routing_header_value"]

log = logging.getLogger(__name__)

ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"
"""Response header in which the router (smg) names the engine, by URL, that served a request."""

_VALID_KEY = re.compile(r"^[!-~]{1,128}$")  # a routing key smg accepts: 1-128 visible ASCII characters


def routing_header_value(key: str) -> str:
    """The routing key as the router accepts it: as is when it is 1-128 visible ASCII characters, else a
    digest (smg ignores a longer or non-ASCII key and would place the request at random)."""
    if _VALID_KEY.match(key):
        return key
    return "h-" + hashlib.blake2b(key.encode("utf-8"), digest_size=16).hexdigest()


class SmgWorkers:
    """smg's ``/workers`` at ``router_url``, through the client's ``http`` and ``keys``."""

    def __init__(self, http: httpx.AsyncClient, router_url: str, keys: ServiceKeys) -> None:
        self.http = http
        self.router_url = router_url
        self.keys = keys

    def _failed(self, resp: httpx.Response, what: str) -> Exception:
        return EngineHTTPError(
            f"{self.router_url}/workers{what}: HTTP {resp.status_code}: {response_message(resp)}", resp.status_code
        )

    async def listed(self) -> dict[str, dict[str, Any]]:
        """The router's workers by URL (``GET /workers``)."""
        resp = await self.http.get(self.router_url + "/workers", headers=self.keys.headers(control=True), timeout=10)
        if resp.status_code >= 400:
            raise self._failed(resp, "")
        workers = resp.json().get("workers", [])
        return {str(w.get("url", "")).rstrip("/"): w for w in workers if isinstance(w, dict)}

    async def has(self, url: str, *, ready: bool = False) -> bool:
        """Whether the router still lists ``url`` (``ready``: and routes to it)."""
        worker = (await self.listed()).get(url)
        if worker is None:
            return False
        return not ready or (bool(worker.get("is_healthy")) and worker.get("status", "ready") == "ready")

    async def register(self, url: str) -> None:
        """``POST /workers``: the router routes to ``url`` once it finds it healthy."""
        # (smg talks to the engine with the key given here: without it, a keyed engine refuses smg)
        spec = {"url": url, **({"api_key": self.keys.api_key} if self.keys.api_key else {})}
        admin = self.keys.headers(control=True)
        resp = await self.http.post(self.router_url + "/workers", json=spec, headers=admin, timeout=30)
        if resp.status_code >= 400:
            raise self._failed(resp, f" (POST {url})")
        log.info("router %s: registered %s", self.router_url, url)

    async def remove(self, url: str) -> None:
        """``DELETE /workers/{id}``: the router drains ``url`` (no new requests; those in flight finish)."""
        worker = (await self.listed()).get(url)
        if worker is None:
            return
        admin = self.keys.headers(control=True)
        resp = await self.http.delete(f"{self.router_url}/workers/{worker['id']}", headers=admin, timeout=30)
        if resp.status_code >= 400:
            raise self._failed(resp, f" (DELETE {url})")
        log.info("router %s: draining %s", self.router_url, url)
