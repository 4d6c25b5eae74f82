"""The fleet's three parties without a run: the CLI's requests (:func:`submit`), the launching host's
:class:`FleetController` over a recording launcher, and trainer rank 0's :class:`FleetFollower` over a real
:class:`HttpEngineClient` whose engines and router answer through ``httpx.MockTransport`` (smg's ``/workers``
as measured: ``POST`` registers, ``DELETE`` drains then forgets). Real runs: ``tests/integration/test_fleet.py``
and ``tests/multinode``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from miles.auth import OPEN_ROUTES, ServiceKeys, is_control_route
from miles.driver.fleet import FleetFollower, FleetRequest, read_members, read_status, submit
from miles.errors import SettingsError
from miles.host.fleet import FleetController
from miles.rollout.http_client import HttpEngineClient
from miles.rollout.router import FLEET_FILE, EngineFleet


class RecordingLauncher:
    """What the controller asks of a launcher: engines started (up when told), retired."""

    def __init__(self) -> None:
        self.engine_urls = ["http://e0"]
        self.added: list[dict[str, Any]] = []
        self.retired: list[str] = []
        self.up = False

    def add_engine(self, make: Callable[..., Any], *, host: str, resources: dict[str, float] | None = None) -> str:
        url = f"http://e{len(self.engine_urls)}"
        self.engine_urls.append(url)
        self.added.append({"host": host, "resources": resources, "launch": make(len(self.engine_urls) - 1)})
        return url

    def engines_up(self) -> bool:
        return self.up

    def retire_engine(self, url: str) -> None:
        self.retired.append(url)


def controller(tmp_path: Path, launcher: RecordingLauncher) -> FleetController:
    (tmp_path / "settings.json").write_text("{}")
    run = SimpleNamespace(settings=SimpleNamespace(cluster=SimpleNamespace(engine_startup_timeout=60.0)))
    c = FleetController(
        run,  # type: ignore[arg-type]
        launcher,  # type: ignore[arg-type]
        tmp_path,
        EngineFleet(["http://e0"]),
        launch=lambda index: f"launch of engine {index}",
        host="127.0.0.1",
    )
    c.flush = lambda url: None  # type: ignore[method-assign]
    return c


def fleet_json(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / FLEET_FILE).read_text())
    return data


def members(run_dir: Path, **states: str) -> None:
    (run_dir / "fleet" / "members.json").write_text(json.dumps({f"http://{k}": v for k, v in states.items()}))


def test_an_add_then_a_remove_go_through_their_states_one_at_a_time(tmp_path: Path) -> None:
    launcher = RecordingLauncher()
    c = controller(tmp_path, launcher)
    add = submit(tmp_path, FleetRequest("add", resources={"late_node": 1.0}))
    remove = submit(tmp_path, FleetRequest("remove", engine="engine-0"))
    assert add.id < remove.id  # (requests are taken in the order of their ids: when they were asked)
    c.tick()
    assert launcher.added == [{"host": "127.0.0.1", "resources": {"late_node": 1.0}, "launch": "launch of engine 1"}]
    assert read_status(tmp_path, add.id).state == "starting"  # type: ignore[union-attr]
    assert read_status(tmp_path, remove.id).state == "queued"  # type: ignore[union-attr]  (one at a time)
    c.tick()
    assert fleet_json(tmp_path)["joining"] == []  # not up yet: not announced
    launcher.up = True
    c.tick()
    assert fleet_json(tmp_path)["joining"] == ["http://e1"] and fleet_json(tmp_path)["engine_urls"] == ["http://e0"]
    members(tmp_path, e0="serving", e1="joining")
    c.tick()
    assert read_status(tmp_path, add.id).state == "joining"  # type: ignore[union-attr]
    members(tmp_path, e0="serving", e1="serving")  # rank 0: it took a verified push and serves
    c.tick()
    done = read_status(tmp_path, add.id)
    assert done is not None and done.state == "done" and done.url == "http://e1"
    assert fleet_json(tmp_path)["engine_urls"] == ["http://e0", "http://e1"] and fleet_json(tmp_path)["joining"] == []
    c.tick()  # the removal's turn: engine-0 drains
    assert read_status(tmp_path, remove.id).state == "draining"  # type: ignore[union-attr]
    assert fleet_json(tmp_path)["draining"] == ["http://e0"] and launcher.retired == []
    members(tmp_path, e0="removed", e1="serving")  # rank 0 let it go
    c.tick()
    assert launcher.retired == ["http://e0"]
    assert read_status(tmp_path, remove.id).state == "done"  # type: ignore[union-attr]
    assert fleet_json(tmp_path)["engine_urls"] == ["http://e1"] and fleet_json(tmp_path)["draining"] == []


def test_what_cannot_be_done_fails_alone_and_a_restart_ends_what_was_open(tmp_path: Path) -> None:
    launcher = RecordingLauncher()
    c = controller(tmp_path, launcher)
    last = submit(tmp_path, FleetRequest("remove", engine="http://e0"))
    unknown = submit(tmp_path, FleetRequest("remove", engine="engine-7"))
    c.tick()
    c.tick()
    said = read_status(tmp_path, last.id)
    assert said is not None and said.state == "failed" and "last serving engine" in said.message
    said = read_status(tmp_path, unknown.id)
    assert said is not None and said.state == "failed" and "'engine-7' is no serving engine" in said.message
    pending = submit(tmp_path, FleetRequest("add"))
    c.tick()
    c.close()  # the run ended while it was starting
    said = read_status(tmp_path, pending.id)
    assert said is not None and said.state == "failed" and "the run ended" in said.message
    stale = submit(tmp_path, FleetRequest("add"))  # asked while no run was going on
    controller(tmp_path, RecordingLauncher())  # a resumed run: nothing of the earlier start is acted on
    said = read_status(tmp_path, stale.id)
    assert said is not None and said.state == "failed" and "stopped" in said.message
    with pytest.raises(SettingsError, match="holds no run"):
        submit(tmp_path / "elsewhere", FleetRequest("add"))


class FakeFleet:
    """Engines that answer ``/health``, and smg's ``/workers`` (registration, drain), behind MockTransport.
    With ``keys`` each checks them as the real ones do (:mod:`miles.auth`): an engine's control routes need
    the admin key and its generation routes the API key, ``/health`` is open; smg's ``/workers`` (its control
    plane) needs the admin key, and a worker registered there must come with the engines' API key (smg sends
    it the engine). A request without the key it needs is answered 401 and recorded."""

    def __init__(self, urls: list[str], keys: ServiceKeys | None = None) -> None:
        self.workers: dict[str, dict[str, Any]] = {u: self._worker(u) for u in urls}
        self.calls: list[str] = []
        self.keys = keys or ServiceKeys()
        self.refused: list[str] = []

    @staticmethod
    def _worker(url: str) -> dict[str, Any]:
        return {"id": f"id-{url.rsplit('/', 1)[-1]}", "url": url, "is_healthy": True, "status": "ready"}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        router = request.url.host == "router"
        control = path.startswith("/workers") if router else is_control_route(path)
        if path not in OPEN_ROUTES and not self.keys.allows(request.headers.get("authorization"), control=control):
            self.refused.append(f"{method} {request.url}")
            return httpx.Response(401, json={"error": "unauthorized"})
        if not router:
            return httpx.Response(200, json={})
        self.calls.append(f"{method} {path}")
        if path == "/workers" and method == "GET":
            return httpx.Response(200, json={"workers": list(self.workers.values())})
        if path == "/workers" and method == "POST":
            spec = json.loads(request.content)
            url = spec["url"]
            if spec.get("api_key") != self.keys.api_key:  # smg could not reach a keyed engine (smg 1.13: 401s)
                return httpx.Response(400, json={"error": f"{url}: could not detect the backend (401)"})
            self.workers[url] = self._worker(url)
            return httpx.Response(202, json={"status": "accepted"})
        if path.startswith("/workers/") and method == "DELETE":
            url = next(u for u, w in self.workers.items() if w["id"] == path.rsplit("/", 1)[-1])
            self.workers[url]["status"] = "draining"  # forgotten once its requests are done (below)
            return httpx.Response(202, json={"status": "accepted"})
        return httpx.Response(404)


def client_over(fake: FakeFleet, urls: list[str], router: str | None) -> HttpEngineClient:
    """A real client of ``urls`` with the fake's keys, its requests answered by ``fake`` (the headers it sends
    every request, the API key's, kept)."""
    client = HttpEngineClient(urls, router_url=router, api_key=fake.keys.api_key, admin_api_key=fake.keys.admin_api_key)
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(fake), headers=client._http.headers)
    return client


@pytest.mark.parametrize("keys", [None, ServiceKeys("fleet-api-key", "fleet-admin-key")], ids=["open", "keyed"])
def test_a_joining_engine_takes_the_next_push_then_the_router_and_a_drained_one_leaves(
    tmp_path: Path, keys: ServiceKeys | None
) -> None:
    """Keyed (issue 46): every call of the change, the new engine's control calls and the router's
    ``/workers`` (list, register, drain), carries the key it needs; none is refused."""

    async def scenario() -> None:
        fake = FakeFleet(["http://a", "http://b"], keys)
        client = client_over(fake, ["http://a", "http://b"], "http://router")
        follower = FleetFollower(client, tmp_path)
        EngineFleet(["http://a", "http://b"], router_url="http://router", joining=["http://c"]).announce(
            tmp_path / FLEET_FILE
        )
        await follower.poll()
        assert read_members(tmp_path) == {"http://a": "serving", "http://b": "serving", "http://c": "joining"}
        assert "http://c" not in client.urls  # not before a push starts
        await client.check_engines()  # the push starts: it takes control calls (this push), not generation
        assert "http://c" in client.urls and "http://c" not in client.serving()
        client.weights_reached("3")  # verified: it has the weights, the router does not have it yet
        assert client.fleet_state()["http://c"] == "joining" and "http://c" not in fake.workers
        await follower.poll()
        assert "POST /workers" in fake.calls and fake.workers["http://c"]["status"] == "ready"
        assert read_members(tmp_path)["http://c"] == "serving"

        EngineFleet(["http://a", "http://b", "http://c"], router_url="http://router", draining=["http://a"]).announce(
            tmp_path / FLEET_FILE
        )
        await follower.poll()  # the router drains it; no request of this client goes to it either
        assert fake.workers["http://a"]["status"] == "draining" and "http://a" not in client.serving()
        assert read_members(tmp_path)["http://a"] == "draining"
        await client.check_engines()  # the router still has it (requests in flight there): it stays
        assert "http://a" in client.urls
        del fake.workers["http://a"]  # smg forgets it once its load is 0
        await client.check_engines()
        await follower.poll()
        assert "http://a" not in client.urls and read_members(tmp_path)["http://a"] == "removed"
        metrics = client.failover_metrics()
        assert metrics["fleet/engines_added"] == 1.0 and metrics["fleet/engines_removed"] == 1.0
        assert metrics["rollout/engines_serving"] == 2.0
        assert fake.refused == []
        await client.close()

    asyncio.run(scenario())


def test_without_a_router_a_draining_engine_leaves_once_its_requests_are_done(tmp_path: Path) -> None:
    async def scenario() -> None:
        client = client_over(FakeFleet([]), ["http://a", "http://b"], None)
        keys = [f"group-{i}" for i in range(64)]
        before = {k: client.route(k) for k in keys}
        client.outstanding["http://a"] = 2  # two requests in flight on it
        await client.drain_engine("http://a")
        assert client.serving() == ["http://b"] and all(client.route(k) == "http://b" for k in keys)
        await client.check_engines()
        assert "http://a" in client.urls  # its requests are not done
        client.outstanding["http://a"] = 0
        await client.check_engines()
        assert client.urls == ("http://b",) and client.departed == ["http://a"]
        client.add_engine("http://c")
        await client.check_engines()
        client.weights_reached("4")  # no router: it serves at once
        assert client.fleet_state() == {"http://b": "serving", "http://c": "serving", "http://a": "removed"}
        # the ring moved only the keys of the engines that came and went: b kept its own
        assert all(client.route(k) in ("http://b", "http://c") for k in keys if before[k] == "http://b")
        assert {client.route(k) for k in keys} == {"http://b", "http://c"}
        metrics = client.failover_metrics()
        assert metrics["fleet/drained_requests"] == 2.0 and "rollout/routed_requests" not in metrics
        await client.close()

    asyncio.run(scenario())
