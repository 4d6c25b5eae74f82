"""The HTTP :class:`EngineClient`: one async client (httpx) for local engines and SGLang servers.

Routing across several engines:

- with a ``routing_key`` (a sample group, a multi-turn session), consistent hashing on a ring of
  virtual nodes sends every request of the key to the same engine, so they share its prefix cache, and
  adding or removing an engine moves only the keys that engine owned;
- without one, the engine with the fewest requests outstanding from this client gets the request.

With a ``router_url`` (a real router, :mod:`miles.rollout.router`) the client does not route: every
``/generate`` goes to the router with the routing key in the ``routing_key_header`` header, and the
router picks the engine (it names it in its response; ``meta_info["engine_url"]``). Every control call
(abort, pause, continue, flush, model info, weight updates, :meth:`call`) still goes to each engine
directly. A router that gives no answer (its process died) is left: the request in hand and every later one
are routed here, by the ring, so the run goes on without it (a request the router had forwarded is computed
again, with the same seed, by the engine the ring picks).

Failures: transport errors (refused connection, reset, timeout) and HTTP 502/503/504 are retried with
exponential backoff. An engine that still gives no answer is down (:mod:`miles.rollout.failover`): a
``/generate`` it had is re-sent, same payload and seed, to the engine the ring gives next (keyed or not),
and control calls to every engine skip it until it answers ``/health`` and a weight push reaches it. An
unkeyed request that got HTTP 5xx tries another engine. HTTP 4xx is not retried: it raises
:class:`~miles.errors.EngineError` with the engine's message (SGLang's ``{"error": {"message"}}`` or
``{"success": false, "message"}``).
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

from miles.auth import ServiceKeys, is_control_route
from miles.errors import EngineError
from miles.rollout.client import EngineClient
from miles.rollout.failover import EngineHealth, NoEngineLeftError
from miles.rollout.fleet_changes import FleetChanges
from miles.rollout.http_errors import EngineHTTPError, response_message, transport_message
from miles.rollout.protocol import (
    INSTANCE_HEADER,
    LAUNCH_WEIGHT_VERSION,
    GenerateOutput,
    PauseMode,
    SamplingParams,
)
from miles.rollout.smg_workers import ROUTED_WORKER_HEADER, SmgWorkers, routing_header_value

__all__ = ["ROUTED_WORKER_HEADER", "EngineHTTPError", "HttpEngineClient", "routing_header_value"]

log = logging.getLogger(__name__)

_RETRY_STATUS = {502, 503, 504}
HEALTH_ATTEMPTS = 3
"""Connections a ``/health`` probe tries before the engine counts as not answering (:meth:`HttpEngineClient.
_health`: closed kept-alive connections are no death); a probe that times out is not sent again."""


def _without_keys(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k not in ("api_key", "admin_api_key", "launch_command")}


def _hash(value: str) -> int:
    """A hash stable across processes (Python's ``hash`` is salted)."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "big")


class HttpEngineClient(EngineClient):
    """Talks SGLang's native protocol to one or more engines.

    :param urls: base URLs (``http://127.0.0.1:30000``).
    :param api_key: sent as ``Authorization: Bearer`` (default: none; :meth:`EngineFleet.client` passes the
        run's, :mod:`miles.auth`).
    :param admin_api_key: sent instead of ``api_key`` on the control routes (pause, weights, memory, flush,
        abort ...), as the engines then require.
    :param timeout: seconds a request may take (a long generation included).
    :param connect_timeout: seconds to establish a connection.
    :param max_retries: retries after the first attempt for retryable failures.
    :param backoff: first retry delay in seconds (doubles each time, capped at ``max_backoff``).
    :param virtual_nodes: points per engine on the consistent-hash ring.
    :param router_url: base URL of a router that generation goes through (``None``: route here).
    :param routing_key_header: the header that carries the routing key to the router.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeout: float = 3600.0,
        connect_timeout: float = 10.0,
        max_retries: int = 3,
        backoff: float = 0.25,
        max_backoff: float = 4.0,
        virtual_nodes: int = 64,
        router_url: str | None = None,
        routing_key_header: str = "x-session-id",
    ) -> None:
        if not urls:
            raise ValueError("HttpEngineClient needs at least one engine URL")
        self._urls = [u.rstrip("/") for u in urls]
        if len(set(self._urls)) != len(self._urls):
            raise ValueError(f"duplicate engine URLs: {self._urls}")
        self._keys = ServiceKeys(api_key, admin_api_key)
        self._http = httpx.AsyncClient(
            headers=self._keys.headers(),
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.virtual_nodes = virtual_nodes
        self._ring: list[tuple[int, str]] = []
        self._ring_keys: list[int] = []
        self._rebuild_ring(self._urls)
        self.outstanding: dict[str, int] = {url: 0 for url in self._urls}
        """Requests in flight per engine (from this client)."""
        self._rid_url: dict[str, str] = {}
        self.router_url = router_url.rstrip("/") if router_url else None
        """The router generation goes through, if any (``None`` once it gave no answer: routed here)."""
        self._has_router = self.router_url is not None
        self.routed_requests = 0
        """``/generate`` requests the router served since the last :meth:`failover_metrics`."""
        self.routing_key_header = routing_key_header
        self.health_state = EngineHealth(self._urls)
        """Which engines serve, are down or rejoin (:mod:`miles.rollout.failover`)."""
        self.restart_timeout: float | None = None
        """Seconds generation waits for a restarted engine when none serves (:meth:`wait_for_restarts`)."""
        self._waiting = False
        self._instances: dict[str, str] = {}
        """The process each engine's last ``/health`` named (engines that name one: the local engine)."""
        self._verified_version: str | None = None
        """The weight version the last verified push brought every serving engine (:meth:`weights_reached`)."""
        self.fleet = FleetChanges(self.health_state, self.outstanding)
        """Engines joining and leaving while the run goes on (:mod:`miles.rollout.fleet_changes`)."""

    @property
    def urls(self) -> Sequence[str]:
        """The engines that take control calls: every engine but those down."""
        return tuple(self.health_state.reachable())

    def _rebuild_ring(self, urls: Sequence[str]) -> None:
        """The consistent-hash ring over ``urls``: an engine that joins or leaves moves only its own keys."""
        self._ring = sorted((_hash(f"{url}#{i}"), url) for url in urls for i in range(self.virtual_nodes))
        self._ring_keys = [h for h, _ in self._ring]

    # ----------------------------------------------------------------- routing
    def route(self, routing_key: str | None, exclude: Sequence[str] = ()) -> str:
        """The engine a request goes to (see the module docstring); only serving engines are candidates.

        :raises NoEngineLeftError: no engine serves."""
        serving = self.health_state.serving()
        if not serving:
            raise self.health_state.no_engine_left()
        candidates = [u for u in serving if u not in exclude] or serving
        if routing_key is not None:
            i = bisect.bisect(self._ring_keys, _hash(routing_key)) % len(self._ring)
            for step in range(len(self._ring)):
                url = self._ring[(i + step) % len(self._ring)][1]
                if url in candidates:
                    return url
        return min(candidates, key=lambda u: self.outstanding[u])

    # -------------------------------------------------------------------- HTTP
    async def _request(self, method: str, url: str, endpoint: str, payload: dict[str, Any] | None = None) -> Any:
        resp = await self._send(method, url, endpoint, payload)
        if not resp.content:
            return {}
        try:
            return resp.json()
        except ValueError:  # SGLang answers some control routes in plain text (/flush_cache: "Cache flushed. ...")
            return {"message": resp.text}

    async def _send(
        self,
        method: str,
        url: str,
        endpoint: str,
        payload: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """One request with the retry policy of the module docstring; the successful response."""
        delay = self.backoff
        if self._keys.admin_api_key and is_control_route(endpoint):
            headers = {**(headers or {}), **self._keys.headers(control=True)}
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                resp = await self._http.request(method, url + endpoint, json=payload, headers=headers)
            except httpx.TransportError as exc:
                if last:
                    raise EngineError(
                        f"{url}{endpoint}: {transport_message(exc)} (after {attempt + 1} attempts)"
                    ) from exc
                log.debug("%s%s: %s, retrying in %.2fs", url, endpoint, exc, delay)
            else:
                if resp.status_code < 400:
                    return resp
                if resp.status_code not in _RETRY_STATUS or last:
                    raise EngineHTTPError(
                        f"{url}{endpoint}: HTTP {resp.status_code}: {response_message(resp)}", resp.status_code
                    )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_backoff)
        raise AssertionError("unreachable")

    async def call(self, url: str, endpoint: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        result = await self._request("POST", url.rstrip("/"), endpoint, payload or {})
        return result if isinstance(result, dict) else {"result": result}

    async def _all(self, method: str, endpoint: str, payload: dict[str, Any] | None = None) -> list[Any]:
        """``endpoint`` of every reachable engine; one that gives no answer is marked down and skipped (its
        answer left out), an HTTP error raises. Raises :class:`NoEngineLeftError` when none answered."""
        return await self._each(list(self.urls), method, endpoint, payload)

    async def _each(
        self, urls: Sequence[str], method: str, endpoint: str, payload: dict[str, Any] | None = None
    ) -> list[Any]:
        """:meth:`_all` over ``urls``."""
        results = await asyncio.gather(
            *(self._request(method, url, endpoint, payload) for url in urls), return_exceptions=True
        )
        answers = []
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, EngineError) and not isinstance(result, EngineHTTPError):
                self.health_state.mark_down(url, str(result))
            elif isinstance(result, BaseException):
                raise result
            else:
                answers.append(result)
        if not answers:
            raise self.health_state.no_engine_left()
        return answers

    # ---------------------------------------------------------------- failover
    async def check_engines(self) -> list[str]:
        """Probe every engine's ``/health``: a reachable one that does not answer is marked down, a down
        one that answers rejoins (it takes the next weight push); so does one that names another process
        than before (:data:`INSTANCE_HEADER`: it was restarted before a request saw it die). Returns the
        rejoining engines."""
        state = self.health_state
        if await self.fleet.apply(self._router()):
            self._rebuild_ring(state.engines)
        known = dict(self._instances)
        answers = await self._health(state.engines)
        anonymous = [url for url, ok in zip(state.engines, answers, strict=True) if ok and url not in self._instances]
        relaunched = await self._relaunched(anonymous)
        for url, ok in zip(state.engines, answers, strict=True):
            if ok:
                before, now = known.get(url), self._instances.get(url)
                if url not in state.down and url not in state.rejoining:  # it died unseen
                    if before is not None and now != before:
                        state.mark_down(url, "restarted: another process answers at its URL")
                    elif url in relaunched:
                        state.mark_down(url, relaunched[url])
                state.back_up(url)
            elif url not in state.down:
                state.mark_down(url, "no answer to /health")
        return sorted(state.rejoining)

    # ------------------------------------------------------------- fleet changes
    def add_engine(self, url: str) -> None:
        """Engine ``url`` joins the fleet (``miles fleet add``; :meth:`FleetChanges.add`)."""
        self.fleet.add(url)

    async def drain_engine(self, url: str) -> None:
        """Engine ``url`` leaves the fleet (``miles fleet remove``; :meth:`FleetChanges.drain`)."""
        await self.fleet.drain(url, self._router())

    async def route_joined(self, timeout: float = 60.0) -> list[str]:
        """Joined engines that have the weights serve (:meth:`FleetChanges.route_joined`)."""
        return await self.fleet.route_joined(self._router(), timeout)

    def fleet_state(self) -> dict[str, str]:
        """Each engine by URL: ``joining``, ``serving``, ``draining``, ``down`` or ``removed``."""
        return self.fleet.state()

    @property
    def departed(self) -> list[str]:
        """Engines that left the fleet, in order."""
        return self.fleet.departed

    def _router(self) -> SmgWorkers | None:
        return None if self.router_url is None else SmgWorkers(self._http, self.router_url, self._keys)

    async def _relaunched(self, urls: Sequence[str]) -> dict[str, str]:
        """Of ``urls`` (engines whose ``/health`` names no process: SGLang), those that report their launch
        weight version (:data:`LAUNCH_WEIGHT_VERSION`) although a push has brought every engine another
        one: a new process at the engine's URL, with the weights it loaded at start. A push that failed
        midway leaves an engine on the old version or the new one, never on the launch version."""
        verified = self._verified_version
        if verified is None or verified == LAUNCH_WEIGHT_VERSION or not urls:
            return {}

        async def version(url: str) -> str | None:
            try:
                resp = await self._http.get(url + "/model_info", timeout=10)
                return str(resp.json().get("weight_version")) if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        found = await asyncio.gather(*(version(u) for u in urls))
        return {
            url: f"restarted: it serves its launch weight version {v}, where version {verified} was pushed"
            for url, v in zip(urls, found, strict=True)
            if v == LAUNCH_WEIGHT_VERSION
        }

    def serving(self) -> list[str]:
        return self.health_state.serving()

    def wait_for_restarts(self, *, restarts: int, timeout: float) -> None:
        self.health_state.restarts = restarts
        self.restart_timeout = timeout if restarts else None

    async def _serving_again(self, lost: NoEngineLeftError) -> None:
        """No engine serves: wait for one to serve again if a lost one may come back (else raise ``lost``)."""
        state = self.health_state
        if self.restart_timeout is None or not state.may_return():
            raise lost
        if not self._waiting:  # (once for every request that waits)
            log.warning(
                "no engine serves (%s); generation waits up to %.0f s for a restarted one to take the current weights",
                "; ".join(f"{url}: {why}" for url, why in state.down.items()),
                self.restart_timeout,
            )
        self._waiting = True
        deadline = time.monotonic() + self.restart_timeout
        while not state.serving():
            if time.monotonic() >= deadline or not state.may_return():
                raise lost
            await asyncio.sleep(0.2)
        self._waiting = False

    async def wait_for_a_restart(self) -> list[str]:
        state = self.health_state
        if self.restart_timeout is None or not state.may_return():
            return []
        log.warning(
            "no engine is left (%s); waiting up to %.0f s for a restarted one",
            ", ".join(state.may_return()),
            self.restart_timeout,
        )
        deadline = time.monotonic() + self.restart_timeout
        while state.may_return():
            rejoining = await self.check_engines()
            if rejoining or time.monotonic() >= deadline:
                return rejoining
            await asyncio.sleep(0.5)
        return []

    def rejoining(self) -> list[str]:
        state = self.health_state
        return [url for url in state.engines if url in state.rejoining]

    def weights_reached(self, version: str) -> list[str]:
        """The weight push of ``version`` reached every reachable engine: rejoining ones serve again; engines
        that joined the fleet serve too, or, with a router, wait to be registered (:meth:`route_joined`)."""
        self._verified_version = version
        back = self.health_state.rejoined(version)
        self.fleet.weights_reached(back, routed=self.router_url is not None)
        return back

    def failover_metrics(self) -> dict[str, float]:
        """The failover metrics (:meth:`EngineHealth.take_metrics`) and, with a router, ``rollout/routed_requests``
        (requests it served since the last call: 0 while generation bypasses it)."""
        out = self.health_state.take_metrics()
        if self.fleet.drained_requests or "fleet/engines_removed" in out:
            out["fleet/drained_requests"] = float(self.fleet.drained_requests)
            self.fleet.drained_requests = 0
        if self._has_router:
            out["rollout/routed_requests"] = float(self.routed_requests)
            self.routed_requests = 0
        return out

    async def wait_until_healthy(self, timeout: float, *, interval: float = 0.5) -> None:
        """Every engine answers ``/health`` (:meth:`EngineClient.wait_until_healthy`) and the router, if any,
        answers ``/readiness`` from this process: a router this process cannot reach (it listens on another
        host's loopback) is an error naming ``rollout.router``, not a run that quietly routes around it."""
        await super().wait_until_healthy(timeout, interval=interval)
        if self.router_url is None:
            return
        deadline = time.monotonic() + min(timeout, 30.0)
        while True:
            try:
                resp = await self._http.get(self.router_url + "/readiness", timeout=5)
                if resp.status_code < 500:
                    return
                why = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                why = transport_message(exc)
            if time.monotonic() >= deadline:
                from miles.node_address import node_address

                raise EngineError(
                    f"rollout.router: trainer rank 0 (on {node_address()}) cannot reach the router at "
                    f"{self.router_url} ({why}); the launcher places it (cluster.host on the driver's host, or "
                    "cluster.launcher.router_resources with the ray launcher): give it an address this node reaches"
                )
            await asyncio.sleep(interval)

    # ---------------------------------------------------------------- generate
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
        routing_key: str | None = None,
        rid: str | None = None,
        image_data: Sequence[str] | None = None,
    ) -> list[GenerateOutput]:
        """See :meth:`EngineClient.generate`. Each output's ``meta_info["engine_url"]`` names the engine."""
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params.to_json(),
            "return_logprob": return_logprob,
        }
        if return_routed_experts:
            payload["return_routed_experts"] = True
        if image_data:
            payload["image_data"] = list(image_data)
        if rid is not None:
            payload["rid"] = rid
        if self.lora_path is not None:
            payload["lora_path"] = self.lora_path
        if self.return_sampling_mask:
            payload["return_sampling_mask"] = True
        if self.router_url is not None:
            try:
                body, url = await self._generate_via_router(payload, routing_key)
                return self._outputs(body, url)
            except EngineHTTPError:
                raise
            except EngineError as exc:  # no answer from the router: route here from now on
                if self.router_url is not None:
                    log.error("the router gives no answer (%s); routing to the engines directly from now on", exc)
                    self.router_url = None
        tried: list[str] = []
        delay = self.backoff
        while True:
            try:
                url = self.route(routing_key, exclude=tried if routing_key is None else ())
            except NoEngineLeftError as lost:
                await self._serving_again(lost)  # (or raises: fail-stop)
                continue
            self.outstanding[url] += 1
            if rid is not None:
                self._rid_url[rid] = url
            try:
                body = await self._request("POST", url, "/generate", payload)
                break
            except EngineHTTPError as exc:
                # an engine error: an unkeyed request may still be served by another engine
                if routing_key is not None or exc.status < 500 or len(tried) + 1 >= len(self.health_state.serving()):
                    raise
                tried.append(url)
                log.warning("engine %s failed (%s); trying another", url, exc)
                await asyncio.sleep(delay)
            except EngineError as exc:
                # no answer: the engine is down; the request (same seed) goes to the next engine
                self.health_state.mark_down(url, str(exc))
                self.health_state.requests_retried += 1
                log.warning("re-sending a /generate (rid %s, key %s) that %s did not answer", rid, routing_key, url)
            finally:
                self.outstanding[url] -= 1
                if rid is not None:
                    self._rid_url.pop(rid, None)
        return self._outputs(body, url)

    async def _generate_via_router(self, payload: dict[str, Any], routing_key: str | None) -> tuple[Any, str]:
        """``/generate`` through the router; the body and the engine that served it (as the router says)."""
        assert self.router_url is not None
        headers = {self.routing_key_header: routing_header_value(routing_key)} if routing_key is not None else None
        resp = await self._send("POST", self.router_url, "/generate", payload, headers=headers)
        self.routed_requests += 1
        served_by = resp.headers.get(ROUTED_WORKER_HEADER, "").rstrip("/")
        return resp.json(), served_by if served_by in self.health_state.engines else self.router_url

    @staticmethod
    def _outputs(body: Any, url: str) -> list[GenerateOutput]:
        entries = body if isinstance(body, list) else [body]
        outputs = []
        for entry in entries:
            out = GenerateOutput.from_json(entry)
            out.meta_info["engine_url"] = url
            outputs.append(out)
        return outputs

    # ------------------------------------------------------------------- admin
    async def abort(self, rid: str | None = None) -> None:
        if rid is None:
            await self._all("POST", "/abort_request", {"abort_all": True})
            return
        url = self._rid_url.get(rid)
        await self._each(
            [url] if url is not None and url in self.urls else list(self.urls), "POST", "/abort_request", {"rid": rid}
        )

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        await self._all("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._all("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._all("POST", "/flush_cache", {})

    async def model_info(self) -> list[dict[str, Any]]:
        return await self._all("GET", "/model_info")

    async def server_info(self) -> list[dict[str, Any]]:
        """Each engine's ``/server_info``, without what names a key (SGLang 0.5.23 reports its ``api_key``,
        ``admin_api_key`` and the launch command line there)."""
        return [_without_keys(i) if isinstance(i, dict) else {} for i in await self._all("GET", "/server_info")]

    async def models(self, url: str) -> list[dict[str, Any]]:
        result = await self._request("GET", url.rstrip("/"), "/v1/models")
        data = result.get("data", []) if isinstance(result, dict) else []
        return [m for m in data if isinstance(m, dict)]

    async def release_memory(self, tags: Sequence[str] = ("kv_cache", "weights")) -> None:
        """:meth:`EngineClient.release_memory` on every reachable engine; one that gives no answer is marked down
        and left (a colocated run goes on: the next push takes a restarted engine back), even the last one."""
        await self._each_answering("/release_memory_occupation", {"tags": list(tags)})

    async def resume_memory(self, tags: Sequence[str] = ("kv_cache", "weights")) -> None:
        """:meth:`EngineClient.resume_memory`, leaving engines that give no answer as :meth:`release_memory`."""
        await self._each_answering("/resume_memory_occupation", {"tags": list(tags)})

    async def _each_answering(self, endpoint: str, payload: dict[str, Any]) -> None:
        """POST ``endpoint`` to every reachable engine; an engine that answers no more is marked down and left
        (no error, also when none answers: there is nothing to ask of a dead engine), an HTTP error raises."""
        urls = list(self.urls)
        results = await asyncio.gather(
            *(self._request("POST", url, endpoint, payload) for url in urls), return_exceptions=True
        )
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, EngineError) and not isinstance(result, EngineHTTPError):
                self.health_state.mark_down(url, str(result))
            elif isinstance(result, BaseException):
                raise result

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        await self._all(
            "POST", "/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version}
        )

    async def update_weight_version(self, weight_version: str) -> None:
        await self._all("POST", "/update_weight_version", {"new_version": weight_version, "abort_all_requests": False})

    async def health(self) -> list[bool]:
        """Whether each engine of the client answers ``/health`` (down ones included)."""
        return await self._health(self.health_state.engines)

    async def _health(self, urls: Sequence[str]) -> list[bool]:
        """``/health`` of each of ``urls``; records the process each names (:data:`INSTANCE_HEADER`). A probe
        whose connection failed is sent again (up to :data:`HEALTH_ATTEMPTS` in all) before the engine counts
        as not answering: a kept-alive connection the engine closed as it was reused (uvicorn closes one idle
        for 5 s, about the time between two pushes when generation goes through a router) is dropped from the
        pool, and is no death."""

        async def one(url: str) -> bool:
            for attempt in range(1, HEALTH_ATTEMPTS + 1):
                try:
                    resp = await self._http.get(url + "/health", timeout=10)
                    break
                except httpx.TimeoutException:  # (it had 10 s to answer)
                    return False
                except httpx.HTTPError as exc:
                    if attempt == HEALTH_ATTEMPTS:
                        return False
                    log.debug("%s/health: %s; asking again", url, exc or type(exc).__name__)
            instance = resp.headers.get(INSTANCE_HEADER)
            if resp.status_code == 200 and instance:
                self._instances[url] = instance
            return resp.status_code == 200

        return list(await asyncio.gather(*(one(u) for u in urls)))

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> HttpEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
