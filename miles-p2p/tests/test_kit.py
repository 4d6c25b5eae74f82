"""The ``p2p`` plugin through Miles' conformance kit: plugin shape, cheap import, and delivery into a real
local engine from randomized weights (a left-out tensor caught by name), over two data paths."""

from __future__ import annotations

from pathlib import Path

import pytest

import miles_p2p.plugin as plugin
from miles.testing import check_light_import, check_plugin, check_transport, check_transport_delivery
from miles_p2p.settings import P2PTransportSettings
from miles_p2p.transport import P2PTransport


def test_plugin_conforms(tmp_path: Path) -> None:
    (entry,) = check_plugin(plugin, name="p2p", expect=[("transport", "p2p")])
    assert entry.component is P2PTransport and entry.settings_model is P2PTransportSettings
    check_transport(P2PTransport, tmp_path)
    check_light_import("miles_p2p.plugin")


@pytest.mark.slow  # one engine process each
@pytest.mark.parametrize("settings", [{"datapath": "torch"}, {"datapath": "shm", "write_into_weights": True}])
def test_delivers_into_a_real_engine(tmp_path: Path, settings: dict[str, object]) -> None:
    facts = check_transport_delivery(P2PTransport, tmp_path, settings=settings, engine_dtype="bfloat16")
    assert facts["verified_tensors"] > 0
