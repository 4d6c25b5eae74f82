"""The run's keys (issue 46): loopback needs none, anything else does; SGLang's two levels (an API key, an
admin key for the control routes) on the local engine; the keys never on a command line, in
``settings.json`` or ``/server_info``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles.auth import API_KEY_ENV, ServiceKeys, check_bind, is_control_route, is_loopback
from miles.errors import SettingsError

API, ADMIN = "api-0123456789", "admin-9876543210"


def test_loopback_addresses() -> None:
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.2", "192.168.1.9", "node-3", ""):
        assert not is_loopback(host), host


def test_beyond_loopback_a_key_is_required_and_the_error_names_the_setting() -> None:
    check_bind("127.0.0.1", ServiceKeys(), service="x", setting="--api-key")
    check_bind("0.0.0.0", ServiceKeys(API), service="x", setting="--api-key")
    with pytest.raises(SettingsError, match=r"--api-key: miles serve would listen on 0\.0\.0\.0.*MILES_API_KEY"):
        check_bind("0.0.0.0", ServiceKeys(), service="miles serve", setting="--api-key")
    with pytest.raises(SettingsError, match="cluster.api_key"):  # an admin key alone does not do
        check_bind("10.1.2.3", ServiceKeys(None, ADMIN), service="the router", setting="cluster.api_key")


def test_sglangs_decision_for_each_configuration() -> None:
    """The table of SGLang 0.5.23's ``decide_request_auth`` (``sglang/srt/utils/auth.py``): with both keys
    neither opens the other's routes; an admin key alone leaves the generation routes open."""
    bearer = {None: None, "api": f"Bearer {API}", "admin": f"Bearer {ADMIN}", "wrong": "Bearer nope"}
    expected = {  # (keys configured) -> {(sent, control route): allowed}
        (API, None): {("api", False): True, ("api", True): True, ("admin", True): False, (None, False): False},
        (API, ADMIN): {("api", False): True, ("api", True): False, ("admin", True): True, ("admin", False): False},
        (None, ADMIN): {(None, False): True, ("admin", True): True, ("api", True): False, ("wrong", False): True},
        (None, None): {(None, False): True, (None, True): True},
    }
    for (api, admin), cases in expected.items():
        keys = ServiceKeys(api, admin)
        for (sent, control), allowed in cases.items():
            assert keys.allows(bearer[sent], control=control) is allowed, (api, admin, sent, control)
    assert ServiceKeys(API).allows(f"bearer {API}", control=False)  # the scheme is case-insensitive
    assert not ServiceKeys(API).allows(API, control=False)


def test_control_routes_are_every_route_but_the_generation_ones() -> None:
    for path in ("/update_weights_from_disk", "/pause_generation", "/flush_cache", "/abort_request",
                 "/load_lora_adapter", "/debug/randomize_weights", "/p2p/open_session", "/weights_checksum",
                 "/release_memory_occupation", "/a_route_a_plugin_adds"):  # fmt: skip
        assert is_control_route(path), path
    for path in ("/generate", "/model_info", "/server_info", "/health_generate", "/v1/models", "/health"):
        assert not is_control_route(path), path


def test_keys_never_show_in_a_repr_and_travel_in_the_environment() -> None:
    keys = ServiceKeys(API, ADMIN)
    assert API not in repr(keys) and ADMIN not in repr(keys)
    assert keys.env() == {API_KEY_ENV: API, "MILES_ADMIN_API_KEY": ADMIN}
    assert ServiceKeys.from_env(keys.env()) == keys
    assert keys.headers_for("/generate") == {"Authorization": f"Bearer {API}"}
    assert keys.headers_for("/pause_generation") == {"Authorization": f"Bearer {ADMIN}"}
    assert ServiceKeys(API).headers(control=True) == {"Authorization": f"Bearer {API}"}
    assert keys.client_only() == ServiceKeys(API)


def test_the_settings_key_is_never_written_nor_printed(tmp_path: Path) -> None:
    from miles.host.rundir import write_resolved_settings
    from miles.settings.loader import load_settings

    settings = load_settings(overrides=[f"cluster.api_key={API}", f"cluster.admin_api_key={ADMIN}"])
    assert ServiceKeys.of_cluster(settings.cluster, {}) == ServiceKeys(API, ADMIN)
    write_resolved_settings(settings, tmp_path / "settings.json")
    text = (tmp_path / "settings.json").read_text()
    assert API not in text and ADMIN not in text and "api_key" not in text
    assert API not in repr(settings) and API not in str(settings.model_dump())
    # the environment variable is the source when the setting is unset (every rank reads settings.json)
    again = load_settings(overrides=[], env={})
    assert ServiceKeys.of_cluster(again.cluster, {API_KEY_ENV: "from-env"}) == ServiceKeys("from-env")
    nested = load_settings(env={"MILES_CLUSTER__API_KEY": API})
    assert ServiceKeys.of_cluster(nested.cluster, {}).api_key == API


def test_engine_keys_never_reach_a_command_line_or_server_info(tmp_path: Path) -> None:
    from miles.engine.options import ServeOptions, to_argv

    (tmp_path / "config.json").write_text("{}")
    opts = ServeOptions(model=tmp_path, api_key=API, admin_api_key=ADMIN, host="0.0.0.0")
    argv = to_argv(opts)
    assert "--host" in argv and API not in argv and ADMIN not in argv and "--api-key" not in argv
    info = json.dumps(opts.server_info())
    assert API not in info and ADMIN not in info
    assert API not in repr(opts)


def test_miles_serve_beyond_loopback_without_a_key_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    argv = [sys.executable, "-m", "miles.engine", "--model", str(tmp_path), "--host", "0.0.0.0", "--port", "0"]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MILES_")}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--api-key: miles serve would listen on 0.0.0.0, beyond loopback, without an API key" in out.stderr


@pytest.fixture(scope="module")
def keyed_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The local engine's app with both keys, over a real scheduler and a tiny model (in process)."""
    import torch
    from starlette.testclient import TestClient

    from miles.engine.launch import start_engine
    from miles.engine.options import ServeOptions
    from miles.engine.server import create_app
    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path_factory.mktemp("auth") / "qwen2", "qwen2", seed=0)
    state = start_engine(ServeOptions(model=model, threads=1, context_length=64, api_key=API, admin_api_key=ADMIN))
    try:
        with TestClient(create_app(state)) as client:
            yield client
    finally:
        state.scheduler.stop()


def test_the_local_engine_checks_both_levels(keyed_engine: Any) -> None:
    client = keyed_engine
    api, admin = {"Authorization": f"Bearer {API}"}, {"Authorization": f"Bearer {ADMIN}"}
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert client.get("/health").status_code == 200 and client.get("/health").content == b""
    for headers in ({}, admin, {"Authorization": "Bearer nope"}):
        resp = client.post("/generate", json=body, headers=headers)
        assert resp.status_code == 401 and "the API key" in resp.json()["error"]["message"], resp.text
        assert client.get("/model_info", headers=headers).status_code == 401
    for headers in ({}, api):
        resp = client.post("/flush_cache", json={}, headers=headers)
        assert resp.status_code == 401 and "the admin key" in resp.json()["error"]["message"]
        assert client.post("/update_weights_from_disk", json={"model_path": "/x"}, headers=headers).status_code == 401
    assert client.post("/generate", json=body, headers=api).status_code == 200
    assert client.get("/server_info", headers=api).status_code == 200
    assert API not in client.get("/server_info", headers=api).text
    assert client.post("/flush_cache", json={}, headers=admin).status_code == 200
    assert client.post("/pause_generation", json={"mode": "abort"}, headers=admin).status_code == 200
    assert client.post("/continue_generation", json={}, headers=admin).status_code == 200


def test_a_key_on_a_command_line_is_never_logged() -> None:
    from miles.auth import redact_argv

    argv = ["smg", "launch", "--api-key", API, "--control-plane-api-keys", f"m:m:admin:{ADMIN}", "--port", "1"]
    assert redact_argv(argv) == ["smg", "launch", "--api-key", "<redacted>", "--control-plane-api-keys",
                                 "<redacted>", "--port", "1"]  # fmt: skip
    assert redact_argv([f"--api-key={API}", "--host", "h"]) == ["--api-key=<redacted>", "--host", "h"]
