"""The protocol-server skeleton (:mod:`miles.engine.protocol_app`) over an engine of this test's own: every
shared route calls the engine's operation and answers in SGLang's shapes, the API key is checked, the debug
route exists only when asked for. (The local engine's answers through it: ``test_server.py``, ``test_weights.py``.)"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from miles.engine.protocol_app import ServedEngine, create_protocol_app
from miles.rollout.protocol import INSTANCE_HEADER
from miles.types import PauseMode


class RecordingEngine(ServedEngine):
    """Records each operation; weights are a counter."""

    def __init__(self, *, api_key: str | None = None, debug: bool = False) -> None:
        self.api_key = api_key
        self.instance = "i-1"
        self.server_args = {"enable_debug_endpoints": debug, "model": "m"}
        self.version = "0"
        self.calls: list[tuple[str, Any]] = []

    @property
    def weight_version(self) -> str:
        return self.version

    async def generation_healthy(self) -> bool:
        return True

    def model_info(self) -> dict[str, Any]:
        return {"model_path": "m", "weight_version": self.version}

    async def server_info(self) -> dict[str, Any]:
        return {**self.server_args, "weight_version": self.version}

    async def abort(self, rid: str | None, message: str) -> int:
        self.calls.append(("abort", (rid, message)))
        return 2

    async def pause(self, mode: PauseMode) -> None:
        self.calls.append(("pause", mode))

    async def resume(self) -> None:
        self.calls.append(("resume", None))

    async def flush_cache(self) -> str:
        return "flushed"

    async def load_weights_from_disk(
        self, path: str, *, version: str | None, flush_cache: bool, abort_all_requests: bool
    ) -> tuple[str, str]:
        if path == "/forbidden":
            raise PermissionError("model_path: /forbidden is outside the allowed directories")
        self.version = version or "1"
        self.calls.append(("load", (path, flush_cache, abort_all_requests)))
        return f"loaded {path}", self.version

    async def set_weight_version(self, version: str, *, abort_all_requests: bool) -> None:
        self.version = version
        self.calls.append(("version", (version, abort_all_requests)))

    async def weights_checksum(self) -> dict[str, Any]:
        return {"checksums": {"w": "abc"}, "aliases": {}, "dtype": "float32"}

    async def randomize_weights(self, seed: int) -> int:
        self.calls.append(("randomize", seed))
        return 3


def test_shared_routes_call_the_engine_and_answer_in_sglangs_shapes() -> None:
    engine = RecordingEngine()
    client = TestClient(create_protocol_app(engine, title="test"))
    health = client.get("/health")
    assert health.status_code == 200 and health.headers[INSTANCE_HEADER] == "i-1"
    assert client.get("/health_generate").status_code == 200
    assert client.get("/get_model_info").json() == {"model_path": "m", "weight_version": "0"}
    assert client.get("/server_info").json()["model"] == "m"
    assert client.post("/abort_request", json={"rid": "r7"}).json() == {"success": True, "num_aborted": 2}
    assert client.post("/abort_request", json={"rid": "r7", "abort_all": True}).status_code == 200
    assert client.post("/pause_generation", json={"mode": "retract"}).json()["success"]
    bad = client.post("/pause_generation", json={"mode": "sleep"})
    assert bad.status_code == 400 and bad.json() == {
        "success": False,
        "message": "mode must be one of abort, retract, in_place, got 'sleep'",
    }
    assert client.post("/continue_generation").json()["message"] == "generation continued"
    assert client.get("/flush_cache").json() == {"success": True, "message": "flushed"}
    loaded = client.post("/update_weights_from_disk", json={"model_path": "/w", "weight_version": 5})
    assert loaded.json() == {"success": True, "message": "loaded /w", "weight_version": "5"}
    refused = client.post("/update_weights_from_disk", json={"model_path": "/forbidden"})
    assert refused.status_code == 400 and "outside the allowed directories" in refused.json()["message"]
    assert client.post("/update_weights_from_disk", json={}).json()["message"].startswith("model_path")
    assert (
        client.post("/update_weight_version", json={"new_version": "9", "abort_all_requests": True}).json()[
            "new_version"
        ]
        == "9"
    )
    assert client.get("/get_weight_version").json() == {"weight_version": "9"}
    assert client.post("/weights_checksum").json() == {
        "success": True,
        "weight_version": "9",
        "checksums": {"w": "abc"},
        "aliases": {},
        "dtype": "float32",
    }
    assert client.post("/debug/randomize_weights", json={"seed": 1}).status_code == 404
    assert engine.calls == [
        ("abort", ("r7", "aborted by /abort_request")),
        ("abort", (None, "aborted by /abort_request")),
        ("pause", "retract"),
        ("resume", None),
        ("load", ("/w", True, False)),
        ("version", ("9", True)),
    ]


def test_the_api_key_guards_every_route_and_debug_routes_are_opt_in() -> None:
    engine = RecordingEngine(api_key="k", debug=True)
    client = TestClient(create_protocol_app(engine, title="test"))
    denied = client.get("/model_info")
    assert denied.status_code == 401 and "API key" in denied.json()["error"]["message"]
    assert client.get("/health").status_code == 200  # the liveness probe: open, empty (SGLang's are open too)
    headers = {"Authorization": "Bearer k"}
    assert client.get("/model_info", headers=headers).status_code == 200
    answer = client.post("/debug/randomize_weights", json={"seed": 4}, headers=headers).json()
    assert answer == {"success": True, "num_tensors": 3} and engine.calls == [("randomize", 4)]
    unchecked = TestClient(create_protocol_app(RecordingEngine(api_key="k"), title="test", check_api_key=False))
    assert unchecked.get("/model_info").status_code == 200


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info", "/server_info", "/get_server_info"])
def test_both_spellings_of_the_info_routes(path: str) -> None:
    assert TestClient(create_protocol_app(RecordingEngine(), title="test")).get(path).status_code == 200
