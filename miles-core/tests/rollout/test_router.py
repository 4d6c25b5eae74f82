"""The router module without a router: the ``rollout.router`` setting, the smg command line per policy, the
routing-key header value, the fleet record of ``launch.json`` and the start-up errors. A real smg in
front of real engines is tested in ``tests/integration/test_router.py``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from miles.errors import LaunchError, SettingsError
from miles.rollout import router
from miles.rollout.http_client import HttpEngineClient, routing_header_value
from miles.rollout.router import EngineFleet, smg_argv, wait_for_router
from miles.settings.loader import load_settings
from miles.settings.model import MilesSettings, RouterSettings

URLS = ["http://127.0.0.1:31001", "http://127.0.0.1:31002"]


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_router_setting_is_a_name_or_a_table(tmp_path: Path) -> None:
    assert MilesSettings().rollout.router.name == "none"
    assert MilesSettings.model_validate({"rollout": {"router": "smg"}}).rollout.router.policy == "manual"
    table = {"name": "smg", "policy": "cache_aware", "extra_args": ["--cache-threshold", "0.5"]}
    settings = MilesSettings.model_validate({"rollout": {"router": table}})
    assert MilesSettings.model_validate(settings.model_dump(mode="json")).rollout.router == settings.rollout.router
    config = tmp_path / "run.toml"
    config.write_text('[rollout.router]\nname = "smg"\nassignment_mode = "min_load"\n')
    loaded = load_settings(config, overrides=["rollout.router.policy=consistent_hashing"])
    assert (loaded.rollout.router.name, loaded.rollout.router.policy) == ("smg", "consistent_hashing")
    assert loaded.rollout.router.assignment_mode == "min_load"
    assert load_settings(overrides=["rollout.router=smg"]).rollout.router.name == "smg"
    with pytest.raises(ValueError, match="rollout.router.name"):
        MilesSettings.model_validate({"rollout": {"router": "nginx"}})
    with pytest.raises(ValueError, match="rollout.router.policy"):
        MilesSettings.model_validate({"rollout": {"router": {"name": "smg", "policy": "fastest"}}})


def test_smg_command_line_per_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router, "smg_executable", lambda: "/opt/bin/smg")
    argv = smg_argv(RouterSettings(name="smg"), URLS, host="127.0.0.1", port=30100, prometheus_port=30101)
    assert argv[:2] == ["/opt/bin/smg", "launch"]
    assert argv[argv.index("--worker-urls") + 1 : argv.index("--worker-urls") + 3] == URLS
    assert flag_value(argv, "--host") == "127.0.0.1" and flag_value(argv, "--port") == "30100"
    assert flag_value(argv, "--prometheus-host") == "127.0.0.1" and flag_value(argv, "--prometheus-port") == "30101"
    assert flag_value(argv, "--policy") == "manual" and flag_value(argv, "--assignment-mode") == "min_group"
    assert flag_value(argv, "--routing-key-headers") == "x-session-id"
    assert flag_value(argv, "--health-check-endpoint") == "/health"
    assert "--routing-key-override" not in argv
    cache = smg_argv(
        RouterSettings(name="smg", policy="cache_aware", extra_args=["--cache-threshold", "0.5"]),
        URLS,
        host="127.0.0.1",
        port=1,
        prometheus_port=2,
    )
    assert "--routing-key-override" in cache and "--assignment-mode" not in cache
    assert cache[-2:] == ["--cache-threshold", "0.5"]
    rr = smg_argv(RouterSettings(name="smg", policy="round_robin"), URLS, host="127.0.0.1", port=1, prometheus_port=2)
    assert "--routing-key-override" not in rr and flag_value(rr, "--policy") == "round_robin"
    with pytest.raises(SettingsError, match="at least one engine"):
        smg_argv(RouterSettings(name="smg"), [], host="127.0.0.1", port=1, prometheus_port=2)


def test_missing_smg_names_the_install_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SettingsError, match=r"rollout.router: .*pip install smg"):
        router.smg_executable()


def test_routing_keys_smg_would_ignore_are_hashed() -> None:
    assert routing_header_value("group-17") == "group-17"
    assert routing_header_value("x" * 128) == "x" * 128
    for key in ("x" * 129, "a session with spaces", "sessión", ""):
        value = routing_header_value(key)
        assert value.startswith("h-") and len(value) == 34 and value == routing_header_value(key)
    assert routing_header_value("x" * 129) != routing_header_value("x" * 130)


def test_fleet_record_round_trips_and_builds_a_routed_client() -> None:
    fleet = EngineFleet(URLS, router_url="http://127.0.0.1:30100", routing_key_header="x-group")
    again = EngineFleet.from_json(fleet.to_json())
    assert again == fleet
    client = again.client()
    try:
        assert isinstance(client, HttpEngineClient)
        assert list(client.urls) == URLS and client.router_url == "http://127.0.0.1:30100"
        assert client.routing_key_header == "x-group"
    finally:
        import asyncio

        asyncio.run(client.close())
    legacy = EngineFleet.from_json({"engine_urls": URLS, "resume": None})  # a launch.json without a router
    assert legacy.router_url is None and legacy.client().router_url is None


def test_wait_for_router_reports_an_exit_and_a_timeout() -> None:
    with pytest.raises(LaunchError, match="exited before it was ready: exit code 2; bad flag") as info:
        wait_for_router("http://127.0.0.1:9", URLS, timeout=30, exited=lambda: "exit code 2; bad flag")
    assert info.value.process == "router"
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"did not report 2 healthy engines within 0.5 s \(last answer: ConnectError"):
        wait_for_router("http://127.0.0.1:9", URLS, timeout=0.5, poll_interval=0.05)
    assert time.monotonic() - start < 10
