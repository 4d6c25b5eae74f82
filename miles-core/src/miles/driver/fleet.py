"""Engines that join and leave while a run goes on: ``miles fleet add|remove RUN_DIR``.

Three parties, each doing what it already owns, talking through files in the run directory (the one every
process of a run already shares):

- **the CLI** (:func:`submit`) writes a request, ``<run_dir>/fleet/requests/<id>.json``, and follows its
  status, ``<id>.status.json``;
- **the launching host** (``miles train``: :class:`FleetController`, called at every check of the processes)
  takes each request in turn. *Add*: the launcher starts one more engine (with Ray, on a node offering the
  request's resources, perhaps one that joined the cluster after the run started); once it answers, it is
  announced in ``fleet.json`` as *joining*. *Remove*: the engine is announced as *draining*, and once trainer
  rank 0 reports it gone, the launcher stops its process (no engine death: nothing restarts it);
- **trainer rank 0** (:class:`FleetFollower`, a task beside the training loop) applies ``fleet.json`` to its
  engine client (:meth:`~miles.rollout.http_client.HttpEngineClient.add_engine`, ``drain_engine``) and reports
  each engine's state in ``<run_dir>/fleet/members.json``. A joining engine takes the next weight push whole
  (the transport opens a session, forms a group or writes a full version for it) and serves once that push
  is verified — with a router, once the router (smg's ``/workers``) routes to it. A draining engine gets no
  new request (the router is told first and drains it), its requests in flight finish, and it leaves the
  client at the next push. Nothing is lost: requests are never cut, and one that dies with its engine is
  re-sent as on any failure (:mod:`miles.rollout.failover`).

A request is ``queued``, then ``starting`` / ``joining`` (add) or ``draining`` (remove), then ``done`` or
``failed`` (with why). The metrics count the changes (``fleet/engines_added``, ``fleet/engines_removed``,
``fleet/drained_requests``, ``rollout/engines_serving``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from miles.errors import LaunchError, MilesError, SettingsError
from miles.rollout.router import FLEET_FILE, EngineFleet

if TYPE_CHECKING:
    from miles.driver.run import Run
    from miles.launch.base import Launcher
    from miles.rollout.http_client import HttpEngineClient

__all__ = [
    "FINAL",
    "FleetController",
    "FleetFollower",
    "FleetRequest",
    "read_members",
    "read_status",
    "requests_dir",
    "submit",
    "wait_for",
]

log = logging.getLogger(__name__)

FLEET_DIR = "fleet"
"""Under the run directory: ``requests/`` and ``members.json``."""
MEMBERS_FILE = "members.json"
Action = Literal["add", "remove"]
State = Literal["queued", "starting", "joining", "draining", "done", "failed"]
FINAL: tuple[State, ...] = ("done", "failed")


def _request_id() -> str:
    """A new request's id: when it was asked (to the nanosecond: requests are taken in the order of their ids)
    and a random part (two machines asking in the same nanosecond)."""
    now = time.time_ns()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now // 1_000_000_000))
    return f"{stamp}.{now % 1_000_000_000:09d}-{uuid.uuid4().hex[:6]}"


@dataclass
class FleetRequest:
    """One change of the fleet, as the CLI asks it and the launching host reports it."""

    action: Action
    engine: str | None = None
    """``remove``: the engine, by URL or launcher name (``engine-1``); ``add``: unused."""
    resources: dict[str, float] | None = None
    """``add`` with the ``ray`` launcher: custom resources the new engine's node must offer (in place of
    ``cluster.launcher.engine_resources``)."""
    id: str = field(default_factory=lambda: _request_id())
    state: State = "queued"
    url: str | None = None
    """The engine's URL, once known."""
    message: str = ""
    """What happened last (why it failed)."""
    updated: float = field(default_factory=time.time)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FleetRequest:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def _write(path: Path, data: Any) -> None:
    """Write JSON at once (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps(data, indent=1))
    os.replace(scratch, path)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def requests_dir(run_dir: Path) -> Path:
    return run_dir / FLEET_DIR / "requests"


def read_status(run_dir: Path, request_id: str) -> FleetRequest | None:
    """The launching host's latest word on request ``request_id`` (``None``: not taken yet)."""
    data = _read(requests_dir(run_dir) / f"{request_id}.status.json")
    return FleetRequest.from_json(data) if isinstance(data, dict) else None


def read_members(run_dir: Path) -> dict[str, str]:
    """Each engine's state as trainer rank 0 last reported it (URL -> ``joining``, ``serving``, ``draining``,
    ``down`` or ``removed``)."""
    data = _read(run_dir / FLEET_DIR / MEMBERS_FILE)
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def submit(run_dir: Path, request: FleetRequest) -> FleetRequest:
    """Hand ``request`` to the run in ``run_dir`` (its launching host takes it within a second)."""
    if not (run_dir / "settings.json").exists():
        raise SettingsError(f"RUN_DIR: {run_dir} holds no run (no settings.json)")
    if not (run_dir / FLEET_FILE).exists():
        raise SettingsError(f"RUN_DIR: the run in {run_dir} has no engines running (no {FLEET_FILE} yet)")
    _write(requests_dir(run_dir) / f"{request.id}.json", asdict(request))
    return request


def wait_for(run_dir: Path, request: FleetRequest, *, timeout: float, poll: float = 0.5) -> FleetRequest:
    """Follow ``request`` until it is ``done`` or ``failed`` (or ``timeout`` seconds pass: its latest status)."""
    deadline = time.monotonic() + timeout
    seen = request
    while time.monotonic() < deadline:
        status = read_status(run_dir, request.id)
        if status is not None:
            if status.state != seen.state:
                log.info("%s %s: %s %s", status.action, status.url or status.engine or "", status.state, status.message)
            seen = status
            if status.state in FINAL:
                return status
        time.sleep(poll)
    return seen


class FleetController:
    """The launching host's side (``miles train``): requests in, engines started and stopped, ``fleet.json``
    out. :meth:`tick` runs on the launcher's thread at every check of the processes and never blocks for
    long; one request is worked on at a time, in the order they came.

    :param launch: builds engine ``index``'s launch for ``(index, host, port)`` (:func:`~miles.driver.launch.
        engine_launch`).
    """

    def __init__(
        self, run: Run, launcher: Launcher, run_dir: Path, fleet: EngineFleet, *, launch: Any, host: str
    ) -> None:
        self.run = run
        self.launcher = launcher
        self.run_dir = run_dir
        self.fleet = fleet
        self.launch = launch
        self.host = host
        self.queue: list[FleetRequest] = []
        self._seen: set[str] = set()
        self._deadline = 0.0
        self.timeout = run.settings.cluster.engine_startup_timeout
        requests_dir(run_dir).mkdir(parents=True, exist_ok=True)
        (run_dir / FLEET_DIR / MEMBERS_FILE).unlink(missing_ok=True)  # (a resumed run's engines are new)
        for path in requests_dir(run_dir).glob("*.json"):  # an earlier start's requests are over
            if path.name.endswith(".status.json"):
                continue
            self._seen.add(path.stem)
            status = read_status(run_dir, path.stem) or FleetRequest.from_json(_read(path) or {"action": "add"})
            if status.state not in FINAL:
                self._set(status, "failed", "the run was stopped before it was done")
        self.announce()

    def announce(self) -> None:
        self.fleet.announce(self.run_dir / FLEET_FILE)

    # -- the launcher's thread ------------------------------------------------------------------------
    def tick(self) -> None:
        """Take new requests; move the first one on as far as it goes now."""
        self._take_new()
        if not self.queue:
            return
        request = self.queue[0]
        try:
            if request.action == "add":
                self._add(request)
            else:
                self._remove(request)
        except MilesError as exc:
            self._set(request, "failed", str(exc))
        except Exception as exc:  # a broken request must not stop the run
            log.exception("fleet: %s failed", request.id)
            self._set(request, "failed", f"{type(exc).__name__}: {exc}")
        if request.state in FINAL:
            self.queue.pop(0)

    def close(self) -> None:
        """The run ended: requests still open fail, saying so."""
        self._take_new()
        for request in self.queue:
            self._set(request, "failed", f"the run ended while the request was {request.state}")
        self.queue = []

    def _take_new(self) -> None:
        for path in sorted(requests_dir(self.run_dir).glob("*.json")):
            if path.name.endswith(".status.json") or path.stem in self._seen:
                continue
            self._seen.add(path.stem)
            data = _read(path)
            if not isinstance(data, dict) or data.get("action") not in ("add", "remove"):
                log.warning("fleet: ignoring %s (not a request)", path)
                continue
            request = FleetRequest.from_json({**data, "state": "queued"})
            self.queue.append(request)
            self._set(request, "queued", f"{len(self.queue) - 1} request(s) before it")

    def _set(self, request: FleetRequest, state: State, message: str = "") -> None:
        if state != request.state or message != request.message:
            level = logging.WARNING if state == "failed" else logging.INFO
            log.log(level, "fleet: %s %s %s: %s", request.action, request.url or request.engine or "", state, message)
        request.state, request.message, request.updated = state, message, time.time()
        _write(requests_dir(self.run_dir) / f"{request.id}.status.json", asdict(request))

    # -- add ------------------------------------------------------------------------------------------
    def _add(self, request: FleetRequest) -> None:
        if request.state == "queued":
            request.url = self.launcher.add_engine(self.launch, host=self.host, resources=request.resources)
            self._deadline = time.monotonic() + self.timeout
            self._set(request, "starting", "the launcher started it")
        if request.state == "starting":
            if not self.launcher.engines_up():
                if time.monotonic() > self._deadline:
                    assert request.url is not None
                    self.launcher.retire_engine(request.url)
                    raise LaunchError(f"{request.url} did not answer within {self.timeout:g} s")
                return
            assert request.url is not None
            self.flush(request.url)
            self.fleet.joining.append(request.url)
            self.announce()
            self._set(request, "joining", "it answers; trainer rank 0 pushes it the current weights at the next push")
        if request.state == "joining":
            state = read_members(self.run_dir).get(str(request.url))
            if state == "serving":
                self.fleet.joining.remove(str(request.url))
                self.fleet.engine_urls.append(str(request.url))
                self.announce()
                self._set(request, "done", "it has the current weights (verified) and serves")
            elif state in ("down", "removed"):
                raise LaunchError(f"{request.url} is {state} before it served")

    @staticmethod
    def flush(url: str) -> None:
        """Empty the new engine's prefix cache once it is up (its health check generated a token)."""
        import httpx

        with httpx.Client(timeout=60.0, trust_env=False) as client:
            resp = client.post(url + "/flush_cache")
        if resp.status_code >= 400:
            raise LaunchError(f"{url}/flush_cache: HTTP {resp.status_code}: {resp.text[:300]}")

    # -- remove ---------------------------------------------------------------------------------------
    def _resolve(self, engine: str | None) -> str:
        """The URL of ``engine`` (a URL or a launcher name, ``engine-1``), one of the fleet's serving engines."""
        urls = list(self.fleet.engine_urls)
        if engine is None:
            raise SettingsError("ENGINE: name the engine to remove (its URL, or its name such as engine-0)")
        wanted = engine.rstrip("/")
        if wanted in urls:
            return wanted
        names = getattr(self.launcher, "engine_urls", [])
        if wanted.startswith("engine-") and wanted[7:].isdigit() and int(wanted[7:]) < len(names):
            url = str(names[int(wanted[7:])])
            if url in urls:
                return url
        known = ", ".join(urls) or "none"
        raise SettingsError(f"ENGINE: {engine!r} is no serving engine of this run (serving: {known})")

    def _remove(self, request: FleetRequest) -> None:
        if request.state == "queued":
            url = self._resolve(request.engine)
            others = [u for u in self.fleet.engine_urls if u != url and u not in self.fleet.draining]
            if not others:
                raise SettingsError(f"ENGINE: {url} is the last serving engine; add one before removing it")
            request.url = url
            self.fleet.draining.append(url)
            self.announce()
            self._set(request, "draining", "no new requests go to it; those in flight finish")
        if request.state == "draining":
            if read_members(self.run_dir).get(str(request.url)) != "removed":
                return
            url = str(request.url)
            self.launcher.retire_engine(url)
            self.fleet.draining.remove(url)
            self.fleet.engine_urls.remove(url)
            self.announce()
            self._set(request, "done", "trainer rank 0 let it go and its process was stopped")


class FleetFollower:
    """Trainer rank 0's side: ``fleet.json`` applied to the engine client, ``fleet/members.json`` written
    (see the module docstring). :meth:`run` is a task beside the training loop."""

    def __init__(self, client: HttpEngineClient, run_dir: Path, *, poll_interval: float = 0.5) -> None:
        self.client = client
        self.run_dir = run_dir
        self.poll_interval = poll_interval
        self._stamp: tuple[int, int] | None = None
        self._fleet: EngineFleet | None = None
        self._reported: dict[str, str] | None = None

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except MilesError as exc:  # (a router that does not answer now may later)
                log.warning("fleet: %s", exc)
            await asyncio.sleep(self.poll_interval)

    async def poll(self) -> None:
        """Apply what changed in ``fleet.json``; register joined engines with the router; report."""
        path = self.run_dir / FLEET_FILE
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        if (st.st_mtime_ns, st.st_size) != self._stamp:
            data = _read(path)
            if isinstance(data, dict):
                self._stamp = (st.st_mtime_ns, st.st_size)
                self._fleet = EngineFleet.from_json(data)
        fleet = self._fleet
        if fleet is not None:
            for url in fleet.joining:
                self.client.add_engine(url)
            known = self.client.fleet_state()
            for url in fleet.draining:
                if known.get(url.rstrip("/")) not in ("draining", "removed"):
                    await self.client.drain_engine(url)
        await self.client.route_joined()
        self.report()

    def report(self) -> None:
        state = self.client.fleet_state()
        if state != self._reported:
            _write(self.run_dir / FLEET_DIR / MEMBERS_FILE, state)
            self._reported = state
