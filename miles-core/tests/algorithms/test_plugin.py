"""The built-in algorithms plugin: registers every name, imports without torch, shows in ``miles plugins list``."""

from __future__ import annotations

import json
import subprocess
import sys

import miles.algorithms.plugin as plugin
from miles.testing.conformance import check_light_import, check_plugin

NAMES = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo", "sft", "distill")


def test_plugin_registers_every_algorithm() -> None:
    check_plugin(plugin, name="algorithms", expect=[("algorithm", n) for n in NAMES])


def test_plugin_module_imports_without_torch() -> None:
    check_light_import("miles.algorithms.plugin")


def test_miles_plugins_list_shows_algorithms_and_rewards() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from miles.cli import main; main(['plugins', 'list', '--json'])"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    data = json.loads(proc.stdout)
    records = {p["name"]: p for p in data["plugins"]}
    for name in ("algorithms", "rewards"):
        assert records[name]["status"] == "ok", records[name]
    text = json.dumps(records["algorithms"]) + json.dumps(records["rewards"])
    for name in (*NAMES, "math", "exact_match", "regex", "length_penalty", "remote"):
        assert f'"{name}"' in text, name
