"""The launching host's part of engines joining and leaving mid-run (``miles fleet add|remove``; the requests,
reports and trainer rank 0's part: :mod:`miles.driver.fleet`)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.driver.fleet import (
    FINAL,
    FLEET_DIR,
    MEMBERS_FILE,
    FleetRequest,
    State,
    read_json,
    read_members,
    read_status,
    requests_dir,
    write_json,
)
from miles.errors import LaunchError, MilesError, SettingsError
from miles.rollout.router import FLEET_FILE, flush_caches

if TYPE_CHECKING:
    from miles.auth import ServiceKeys
    from miles.compose import Run
    from miles.launch.base import Launcher
    from miles.rollout.router import EngineFleet

__all__ = ["FleetController"]

log = logging.getLogger(__name__)


class FleetController:
    """The launching host's side (``miles train``): requests in, engines started and stopped, ``fleet.json``
    out. :meth:`tick` runs on the launcher's thread at every check of the processes and never blocks for
    long; one request is worked on at a time, in the order they came.

    :param launch: builds engine ``index``'s launch for ``(index, host, port)`` (:func:`~miles.host.train.
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
            status = read_status(run_dir, path.stem) or FleetRequest.from_json(read_json(path) or {"action": "add"})
            if status.state not in FINAL:
                self._set(status, "failed", "the run was stopped before it was done")
        self.announce()

    @property
    def keys(self) -> ServiceKeys:
        """The run's keys (:attr:`EngineFleet.keys`; without them, the environment's)."""
        from miles.auth import ServiceKeys

        return self.fleet.keys if self.fleet.keys is not None else ServiceKeys.from_env()

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
            data = read_json(path)
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
        write_json(requests_dir(self.run_dir) / f"{request.id}.status.json", asdict(request))

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

    def flush(self, url: str) -> None:
        """Empty the new engine's prefix cache once it is up (:func:`~miles.rollout.router.flush_caches`)."""
        flush_caches([url], self.keys)

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
