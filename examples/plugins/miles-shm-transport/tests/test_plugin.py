"""Tests of the ``shm`` transport: conformance with Miles' plugin and transport interfaces, delivery into a
real local engine (verified, a left-out tensor caught by name), and its zero-copy safetensors files."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

import miles_shm_transport.plugin as plugin
from miles.testing import (
    check_entry_point,
    check_light_import,
    check_plugin,
    check_transport,
    check_transport_delivery,
)
from miles_shm_transport.transport import ShmTransport, ShmTransportSettings, write_bucket


def _installed() -> bool:
    return any(ep.name == "shm_transport" for ep in importlib.metadata.entry_points(group="miles.plugins"))


def test_plugin_conforms() -> None:
    (entry,) = check_plugin(plugin, name="shm_transport", expect=[("transport", "shm")])
    assert entry.component is ShmTransport
    assert entry.settings_model is ShmTransportSettings


def test_plugin_module_imports_cheaply() -> None:
    check_light_import("miles_shm_transport.plugin")


def test_transport_interface(tmp_path: Path) -> None:
    check_transport(ShmTransport, tmp_path, settings={"dir": str(tmp_path)})


@pytest.mark.slow  # one engine process
@pytest.mark.parametrize("engine_dtype", ["float32", "bfloat16"])
def test_delivers_into_a_real_engine(tmp_path: Path, engine_dtype: str) -> None:
    facts = check_transport_delivery(ShmTransport, tmp_path, engine_dtype=engine_dtype)
    assert facts["verified_tensors"] > 0 and facts["push_seconds"] > 0
    assert not [p for p in Path("/dev/shm").glob("miles-shm-*")]  # close() removed every version


def test_buckets_are_standard_safetensors_cast_in_place(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    bucket = [("a", torch.randn(5, 3)), ("b", torch.randn(7)), ("empty", torch.zeros(0, 2))]
    written = write_bucket(tmp_path / "x.safetensors", bucket, torch.bfloat16)
    loaded = load_file(str(tmp_path / "x.safetensors"))
    for name, t in bucket:
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], t.to(torch.bfloat16))
        assert torch.equal(written[name], loaded[name])


@pytest.mark.skipif(not _installed(), reason="miles-shm-transport is not installed (pip install -e .)")
def test_entry_point() -> None:
    record = check_entry_point("shm_transport", distribution="miles-shm-transport")
    assert record.status == "ok" and record.version == "0.1.0"
    assert ("transport", "shm") in record.registers
