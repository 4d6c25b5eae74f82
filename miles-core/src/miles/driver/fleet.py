"""Engines that join and leave while a run goes on: ``miles fleet add|remove RUN_DIR``. This module holds the
requests and reports every party reads and writes, and trainer rank 0's part; the launching host's part is
:mod:`miles.host.fleet`.

Three parties, each doing what it already owns, talking through files in the run directory (the one every
process of a run already shares):

- **the CLI** (:func:`submit`) writes a request, ``<run_dir>/fleet/requests/<id>.json``, and follows its
  status, ``<id>.status.json``;
- **the launching host** (``miles train``: :class:`~miles.host.fleet.FleetController`, called at every check of the processes)
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

from miles.errors import MilesError, SettingsError
from miles.rollout.router import FLEET_FILE, EngineFleet

if TYPE_CHECKING:
    from miles.rollout.http_client import HttpEngineClient

__all__ = [
    "FINAL",
    "FLEET_DIR",
    "MEMBERS_FILE",
    "Action",
    "FleetFollower",
    "FleetRequest",
    "State",
    "read_json",
    "read_members",
    "read_status",
    "requests_dir",
    "submit",
    "wait_for",
    "write_json",
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


def write_json(path: Path, data: Any) -> None:
    """Write JSON at once (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps(data, indent=1))
    os.replace(scratch, path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def requests_dir(run_dir: Path) -> Path:
    return run_dir / FLEET_DIR / "requests"


def read_status(run_dir: Path, request_id: str) -> FleetRequest | None:
    """The launching host's latest word on request ``request_id`` (``None``: not taken yet)."""
    data = read_json(requests_dir(run_dir) / f"{request_id}.status.json")
    return FleetRequest.from_json(data) if isinstance(data, dict) else None


def read_members(run_dir: Path) -> dict[str, str]:
    """Each engine's state as trainer rank 0 last reported it (URL -> ``joining``, ``serving``, ``draining``,
    ``down`` or ``removed``)."""
    data = read_json(run_dir / FLEET_DIR / MEMBERS_FILE)
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def submit(run_dir: Path, request: FleetRequest) -> FleetRequest:
    """Hand ``request`` to the run in ``run_dir`` (its launching host takes it within a second)."""
    if not (run_dir / "settings.json").exists():
        raise SettingsError(f"RUN_DIR: {run_dir} holds no run (no settings.json)")
    if not (run_dir / FLEET_FILE).exists():
        raise SettingsError(f"RUN_DIR: the run in {run_dir} has no engines running (no {FLEET_FILE} yet)")
    write_json(requests_dir(run_dir) / f"{request.id}.json", asdict(request))
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
            data = read_json(path)
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
            write_json(self.run_dir / FLEET_DIR / MEMBERS_FILE, state)
            self._reported = state
