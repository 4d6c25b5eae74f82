"""The ``fsdp`` plugin: entry point, registration, settings, import cost, and ``miles plugins list``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.testing.conformance import check_entry_point, check_light_import, check_plugin


def test_plugin_registers_the_fsdp_trainer() -> None:
    import miles_fsdp.plugin as plugin
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    (entry,) = check_plugin(plugin, name="fsdp", expect=[("trainer", "fsdp")])
    assert entry.component is FSDPTrainer
    assert entry.settings_model is FSDPSettings


def test_entry_point_comes_from_the_miles_fsdp_distribution() -> None:
    record = check_entry_point("fsdp", distribution="miles-fsdp")
    assert record.version == "0.1.0"
    assert ("trainer", "fsdp") in record.registers


def test_plugin_and_trainer_modules_import_without_torch() -> None:
    check_light_import("miles_fsdp.plugin")
    check_light_import("miles_fsdp.trainer")


def test_settings_reject_unknown_keys_and_name_the_field() -> None:
    from pydantic import ValidationError

    from miles_fsdp.settings import FSDPSettings

    assert FSDPSettings().reshard_after_forward is True
    with pytest.raises(ValidationError, match="activation_checkpoint"):
        FSDPSettings.model_validate({"activation_checkpoint": True})


def test_miles_plugins_list_shows_trainer_fsdp() -> None:
    miles = Path(sys.executable).with_name("miles")
    assert miles.exists(), f"the miles console script is not installed next to {sys.executable}"
    proc = subprocess.run(
        [str(miles), "plugins", "list", "--json"], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    fsdp = next(p for p in json.loads(proc.stdout)["plugins"] if p["name"] == "fsdp")
    assert fsdp["distribution"] == "miles-fsdp"
    assert fsdp["status"] == "ok"
    assert {"kind": "trainer", "name": "fsdp"} in fsdp["registers"]
