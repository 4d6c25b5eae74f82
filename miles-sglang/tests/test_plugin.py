"""The ``sglang`` plugin: entry point, registrations, settings, import cost, ``miles plugins list``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.testing.conformance import check_entry_point, check_light_import, check_plugin


def test_plugin_registers_the_engine_and_the_transport() -> None:
    import miles_sglang.plugin as plugin
    from miles_sglang.engine import SGLangEngine
    from miles_sglang.settings import SGLangEngineSettings, TensorTransportSettings
    from miles_sglang.tensor_transport import TensorTransport

    entries = check_plugin(plugin, name="sglang", expect=[("rollout_engine", "sglang"), ("transport", "sglang_tensor")])
    by_name = {e.name: e for e in entries}
    assert by_name["sglang"].component is SGLangEngine
    assert by_name["sglang"].settings_model is SGLangEngineSettings
    assert by_name["sglang_tensor"].component is TensorTransport
    assert by_name["sglang_tensor"].settings_model is TensorTransportSettings


def test_entry_point_comes_from_the_miles_sglang_distribution() -> None:
    record = check_entry_point("sglang", distribution="miles-sglang")
    assert record.version == "0.1.0"
    assert ("rollout_engine", "sglang") in record.registers


def test_modules_import_without_torch_or_sglang() -> None:
    for module in (
        "miles_sglang.plugin",
        "miles_sglang.engine",
        "miles_sglang.tensor_transport",
        "miles_sglang.cpu_compat",
    ):
        check_light_import(module, forbidden=("torch", "transformers", "sglang"))


def test_settings_reject_unknown_keys_and_name_the_field() -> None:
    from pydantic import ValidationError

    from miles_sglang.settings import SGLangEngineSettings

    assert SGLangEngineSettings().skip_server_warmup is True
    with pytest.raises(ValidationError, match="tensor_parallel"):
        SGLangEngineSettings.model_validate({"tensor_parallel": 2})
    with pytest.raises(ValidationError, match="mem_fraction_static"):
        SGLangEngineSettings.model_validate({"mem_fraction_static": 1.5})


def test_miles_plugins_list_shows_rollout_engine_sglang() -> None:
    miles = Path(sys.executable).with_name("miles")
    proc = subprocess.run([str(miles), "plugins", "list", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    plugin = next(p for p in json.loads(proc.stdout)["plugins"] if p["name"] == "sglang")
    assert plugin["distribution"] == "miles-sglang" and plugin["status"] == "ok"
    assert {"kind": "rollout_engine", "name": "sglang"} in plugin["registers"]
    assert {"kind": "transport", "name": "sglang_tensor"} in plugin["registers"]
    table = subprocess.run([str(miles), "plugins", "list"], capture_output=True, text=True, timeout=300).stdout
    assert "rollout engine: sglang" in table
