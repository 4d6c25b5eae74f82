"""``miles_engine_routes``: plugins add routes to an engine server's application through the manager; a
hook that raises or claims a route the server has fails its plugin (recorded, its routes left out) and the
server keeps the others; a blocked plugin adds nothing; the local engine's built-in route groups skip an
engine that is not the local one."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from miles.plugins import PluginManager
from miles.testing.plugins import plugin_of


class OtherEngine:
    """An engine that is not the local one (as miles-diffusion's image engine is)."""


def _routes_plugin(path: str, answer: str, *, fail: bool = False) -> Any:
    from miles.markers import hookimpl

    @hookimpl
    def miles_engine_routes(app: FastAPI, engine: object) -> None:
        @app.post(path)
        async def route() -> dict[str, Any]:
            return {"answer": answer, "engine": type(engine).__name__}

        if fail:
            raise RuntimeError("the receiver's library is missing")

    return plugin_of(miles_engine_routes=miles_engine_routes)


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate() -> dict[str, Any]:
        return {"text": "the engine's own"}

    return app


def test_plugins_add_routes_and_broken_ones_are_left_out(caplog: pytest.LogCaptureFixture) -> None:
    pm = PluginManager(entry_points=False, disabled=(), only=())
    pm.register(_routes_plugin("/p/hello", "hello"), "good")
    pm.register(_routes_plugin("/p/broken", "never", fail=True), "broken")
    pm.register(_routes_plugin("/generate", "clash"), "clashing")
    app = _app()
    with caplog.at_level(logging.ERROR, logger="miles.plugins.manager"):
        pm.add_engine_routes(app=app, engine=OtherEngine())
    client = TestClient(app)
    assert client.post("/p/hello").json() == {"answer": "hello", "engine": "OtherEngine"}
    assert client.post("/p/broken").status_code == 404  # added before it raised: taken out again
    assert client.post("/generate").json() == {"text": "the engine's own"}  # the clashing route is left out
    records = {r.name: r for r in pm.records()}
    assert records["good"].status == "ok"
    assert records["broken"].status == "failed"
    assert records["broken"].error == "miles_engine_routes: RuntimeError: the receiver's library is missing"
    assert records["clashing"].status == "failed"
    assert records["clashing"].error == "miles_engine_routes: PluginLoadError: route POST /generate is already served"
    assert {r.message for r in caplog.records} == {
        "plugin broken: its engine routes are left out",
        "plugin clashing: its engine routes are left out",
    }


def test_a_plugin_blocked_by_miles_disable_plugins_adds_no_routes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "routes_plugin_under_test.py").write_text(
        "from miles.markers import hookimpl\n\n"
        "@hookimpl\n"
        "def miles_engine_routes(app):\n"  # a hook may take a subset of the arguments
        "    app.post('/p/hello')(lambda: {'answer': 'hello'})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = [("routes_under_test", "routes_plugin_under_test")]
    served = _app()
    PluginManager(builtins=plugins, entry_points=False).add_engine_routes(app=served, engine=OtherEngine())
    assert TestClient(served).post("/p/hello").json() == {"answer": "hello"}
    monkeypatch.setenv("MILES_DISABLE_PLUGINS", "routes_under_test")
    blocked = _app()
    pm = PluginManager(builtins=plugins, entry_points=False)
    pm.add_engine_routes(app=blocked, engine=OtherEngine())
    assert TestClient(blocked).post("/p/hello").status_code == 404
    assert {r.name: r for r in pm.records()}["routes_under_test"].status == "blocked"


def test_the_local_engines_route_groups_skip_other_engines() -> None:
    pm = PluginManager(entry_points=False)
    app = _app()
    before = len(app.routes)
    pm.add_engine_routes(app=app, engine=OtherEngine())
    assert len(app.routes) == before
    assert {r.name: r for r in pm.records()}["local_engine"].status == "ok"
