"""Everything installed together: each package's plugins are discovered through its entry point."""

from __future__ import annotations

import json
import subprocess
import sys


def _plugins() -> dict[str, dict[str, object]]:
    out = subprocess.run(
        [sys.executable, "-m", "miles", "plugins", "list", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    data = json.loads(out.stdout)
    assert data["schema_version"] == 1
    return {p["name"]: p for p in data["plugins"]}


def test_every_installed_plugin_loads() -> None:
    plugins = _plugins()
    failed = {name: p["error"] for name, p in plugins.items() if p["status"] != "ok"}
    assert failed == {}


def test_backends_come_from_their_distributions() -> None:
    plugins = _plugins()
    assert plugins["fsdp"]["distribution"] == "miles-fsdp"
    assert {"kind": "trainer", "name": "fsdp"} in plugins["fsdp"]["registers"]  # type: ignore[operator]
    assert plugins["megatron"]["distribution"] == "miles-megatron"
    assert {"kind": "trainer", "name": "megatron"} in plugins["megatron"]["registers"]  # type: ignore[operator]
    assert plugins["reward_example"]["distribution"] == "miles-reward-example"
    assert {"kind": "reward", "name": "keyword"} in plugins["reward_example"]["registers"]  # type: ignore[operator]
    assert plugins["p2p"]["distribution"] == "miles-p2p"
    assert {"kind": "transport", "name": "p2p"} in plugins["p2p"]["registers"]  # type: ignore[operator]
    assert plugins["shm_transport"]["distribution"] == "miles-shm-transport"
    assert {"kind": "transport", "name": "shm"} in plugins["shm_transport"]["registers"]  # type: ignore[operator]
    builtin_kinds = {r["kind"] for p in plugins.values() if p["builtin"] for r in p["registers"]}  # type: ignore[attr-defined]
    assert {
        "rollout_engine",
        "transport",
        "precision",
        "algorithm",
        "reward",
        "data_source",
        "launcher",
        "logger",
    } <= builtin_kinds


def test_version_lists_every_package() -> None:
    out = subprocess.run([sys.executable, "-m", "miles", "--version"], capture_output=True, text=True, check=True)
    names = {line.split()[0] for line in out.stdout.splitlines()}
    assert {"miles-core", "miles-fsdp", "miles-megatron", "miles-p2p", "miles-reward-example"} <= names
