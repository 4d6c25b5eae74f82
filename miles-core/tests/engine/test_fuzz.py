"""The local engine's HTTP API fuzzed from its own OpenAPI document with schemathesis (issue 22).

Every operation of the document is fed requests generated from its schema (``miles.engine.api_schema``
describes the bodies), valid ones and invalid ones; every answer must be below 500, a 4xx must say what is
wrong, and afterwards the engine must still generate. The app runs in this process over a real scheduler
and a tiny model (ASGI, no socket). Counts of cases per operation are printed (``-s``) for
docs/reliability.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from miles.engine.api_schema import BODIES

# joining a weight-update group connects to the address in the body and waits for its peers: exercised
# by the transport tests with real peers, not with generated addresses
NOT_FUZZED = ("/init_weights_update_group", "/update_weights_from_distributed")
EXAMPLES = 12
"""Cases per operation and generation mode."""


@pytest.fixture(scope="module")
def app(engine_models: dict[str, Path]) -> Iterator[Any]:
    from miles.engine.launch import start_engine
    from miles.engine.options import ServeOptions
    from miles.engine.server import create_app

    opts = ServeOptions(model=engine_models["qwen2"], threads=1, context_length=64, enable_debug_endpoints=True)
    state = start_engine(opts, start=True)
    try:
        yield create_app(state)
    finally:
        state.scheduler.stop()


def _message(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return str(body.get("message", "")) if isinstance(body, dict) else ""


def _fuzz(
    operation: Any,
    mode: GenerationMode,
    seen: dict[str, int],
    *,
    examples: int = EXAMPLES,
    headers: dict[str, str] | None = None,
    expect: int | None = None,
) -> None:
    """Feed ``operation`` generated requests (with ``headers``); every answer below 500 (and ``expect`` when
    given), a 4xx with a message."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case: Any) -> None:
        if case.path == "/update_weights_from_disk" and isinstance(case.body, dict):
            case.body["model_path"] = "/nonexistent/miles-fuzz"  # never load what a generated path names
        response = case.call_and_validate(checks=[not_a_server_error], timeout=60, headers=headers or {})
        seen[response.status_code // 100 * 100] = seen.get(response.status_code // 100 * 100, 0) + 1
        if expect is not None:
            assert response.status_code == expect, f"{case.method} {case.path}: HTTP {response.status_code}"
        if 400 <= response.status_code < 500 and response.status_code not in (404, 405):
            assert _message(response), f"{case.path}: HTTP {response.status_code} without a message: {response.text}"

    run()


def test_no_generated_request_makes_the_engine_fail(app: Any) -> None:
    from starlette.testclient import TestClient

    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    fuzzed = [op for op in operations if op.path not in NOT_FUZZED]
    assert {"/generate", "/pause_generation", "/update_weights_from_disk", "/get_weights_by_name"} <= {
        op.path for op in fuzzed
    }
    generate = next(op for op in fuzzed if op.path == "/generate")
    assert "input_ids" in generate.definition.raw["requestBody"]["content"]["application/json"]["schema"]["properties"]
    counts: dict[str, dict[int, int]] = {}
    for op in fuzzed:
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.path in BODIES else [])
        for mode in modes:  # (a route without a body has no invalid request to generate)
            _fuzz(op, mode, counts.setdefault(f"{op.method.upper()} {op.path}", {}))
            with TestClient(app) as client:  # a fuzzed pause must not leave the next operation waiting
                client.post("/continue_generation", json={})
    total = sum(sum(c.values()) for c in counts.values())
    print(f"\nfuzzed {len(counts)} operations, {total} requests: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    assert all(5 not in {s // 100 for s in c} for c in counts.values())
    with_body = [op for op in fuzzed if op.path in BODIES]
    assert total >= 2 * len(with_body) * EXAMPLES  # valid and invalid bodies for each
    assert counts["POST /generate"].get(200, 0) > 0  # some generated prompts were served, not only refused


def test_the_engine_still_generates_after_the_fuzzing(app: Any) -> None:
    from starlette.testclient import TestClient

    with TestClient(app) as client:
        assert client.post("/continue_generation", json={}).status_code == 200
        resp = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["output_ids"]) == 4
        assert client.get("/health_generate").status_code == 200


KEY, ADMIN_KEY = "fuzz-api-key-3f9c", "fuzz-admin-key-77d1"
KEYED_EXAMPLES = 4
"""Cases per operation and mode with the keys (the routes' own fuzzing is the run above)."""


@pytest.fixture(scope="module")
def keyed_app(engine_models: dict[str, Path]) -> Iterator[Any]:
    """The same engine with an API key and an admin key (issue 46)."""
    from miles.engine.launch import start_engine
    from miles.engine.options import ServeOptions
    from miles.engine.server import create_app

    opts = ServeOptions(
        model=engine_models["qwen2"],
        threads=1,
        context_length=64,
        enable_debug_endpoints=True,
        api_key=KEY,
        admin_api_key=ADMIN_KEY,
    )
    state = start_engine(opts, start=True)
    try:
        yield create_app(state)
    finally:
        state.scheduler.stop()


def test_with_keys_every_route_refuses_a_request_without_its_key_and_none_fails(keyed_app: Any) -> None:
    """Every operation of the document answers 401 to generated requests without a key, with a wrong key and
    with the other level's key; with its own key (the admin key on control routes, the API key on the
    others) nothing answers 5xx. ``/health`` (an empty liveness answer) is the one open route."""
    from starlette.testclient import TestClient

    from miles.auth import ServiceKeys, is_control_route

    keys = ServiceKeys(KEY, ADMIN_KEY)
    assert TestClient(keyed_app).get("/openapi.json").status_code == 401
    schema = schemathesis.openapi.from_dict(keyed_app.openapi())  # (loaded with headers, they would stick)
    schema.app = keyed_app
    operations = [result.ok() for result in schema.get_all_operations()]
    fuzzed = [op for op in operations if op.path not in NOT_FUZZED]
    assert len(fuzzed) >= 20
    refused: dict[str, dict[int, int]] = {}
    served: dict[str, dict[int, int]] = {}
    for op in fuzzed:
        name = f"{op.method.upper()} {op.path}"
        if op.path == "/health":
            _fuzz(op, GenerationMode.POSITIVE, refused.setdefault(name, {}), examples=2, expect=200)
            continue
        other = {"Authorization": f"Bearer {KEY if is_control_route(op.path) else ADMIN_KEY}"}  # the other level's
        for wrong in ({}, {"Authorization": "Bearer not-the-key"}, other):
            _fuzz(op, GenerationMode.POSITIVE, refused.setdefault(name, {}), examples=2, headers=wrong, expect=401)
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.path in BODIES else [])
        for mode in modes:
            _fuzz(op, mode, served.setdefault(name, {}), examples=KEYED_EXAMPLES, headers=keys.headers_for(op.path))
            with TestClient(keyed_app) as client:
                client.post("/continue_generation", json={}, headers=keys.headers(control=True))
    total_refused = sum(sum(c.values()) for c in refused.values())
    total_served = sum(sum(c.values()) for c in served.values())
    print(f"\nwith keys: {total_refused} requests without the right key (401), {total_served} with it: "
          + ", ".join(f"{k} {v}" for k, v in served.items()))  # fmt: skip
    assert all(set(c) == {400} for name, c in refused.items() if name != "GET /health")  # (401 // 100 * 100)
    assert all(5 not in {s // 100 for s in c} for c in served.values())
    assert served["POST /generate"].get(200, 0) > 0
