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


def test_build_run_refuses_direct_writes_without_shared_memory() -> None:
    """``check_settings``: the composition root refuses ``write_into_weights`` over another data path, naming
    the field, before anything starts; the same settings over ``shm`` resolve."""
    from miles.components import ComponentKind
    from miles.compose import build_run
    from miles.errors import SettingsError
    from miles.plugins.manager import PluginManager
    from miles.settings.model import MilesSettings, TransportSpec

    manager = PluginManager(entry_points=False)
    manager.register(plugin, "p2p")
    kinds = [ComponentKind.TRANSPORT, ComponentKind.PRECISION]  # Run.transport(): the engine dtype
    bad = MilesSettings(transport=TransportSpec(name="p2p", datapath="torch", write_into_weights=True))
    with pytest.raises(SettingsError, match=r"transport\.write_into_weights needs transport\.datapath = 'shm'"):
        build_run(bad, manager, kinds=kinds)
    good = MilesSettings(transport=TransportSpec(name="p2p", datapath="shm", write_into_weights=True))
    transport = build_run(good, manager, kinds=kinds).transport()
    assert isinstance(transport, P2PTransport) and transport.settings.write_into_weights


def test_attach_refuses_a_recipe_that_converts_whole_tensors_only(tmp_path: Path) -> None:
    """A third-party recipe with ``rollout_weights`` and no ``rollout_shards`` cannot go slice by slice: refused
    naming it and the transports that can; the built-in low-precision recipes are taken."""
    from types import SimpleNamespace
    from typing import Any

    from miles.errors import SettingsError
    from miles.precision.base import PrecisionRecipe
    from miles.precision.quantized import FP8

    class Whole(PrecisionRecipe):
        name = "whole"

        def rollout_weights(self, named: Any) -> Any:
            yield from named

    transport = P2PTransport(P2PTransportSettings(), run_dir=str(tmp_path), model_path=None, engine_dtype="bfloat16")
    with pytest.raises(SettingsError, match=r"precision 'whole' converts whole tensors only.*use transport broadcast"):
        transport.attach(SimpleNamespace(precision=Whole(Whole.Settings())))  # type: ignore[arg-type]
    trainer = SimpleNamespace(precision=FP8(FP8.Settings()))
    transport.attach(trainer)  # type: ignore[arg-type]
    assert transport.trainer is trainer


def test_auto_transport_writes_into_the_engines_weights_on_one_host() -> None:
    """``transport = "auto"`` with miles-p2p registered and the local engine on this host: ``p2p`` over shared
    memory written into the engines' weights; engines the launcher may place on other hosts (a Ray cluster):
    ``broadcast``, saying why."""
    from miles.components import ComponentKind
    from miles.compose import build_run
    from miles.plugins.manager import PluginManager
    from miles.settings.model import MilesSettings, PluginSpec, TransportSpec

    manager = PluginManager(entry_points=False)
    manager.register(plugin, "p2p")
    kinds = [ComponentKind.TRANSPORT, ComponentKind.PRECISION]
    settings = MilesSettings(transport=TransportSpec(name="auto"), precision=PluginSpec(name="bf16"))
    run = build_run(settings, manager, kinds=kinds)
    transport = run.transport()
    assert isinstance(transport, P2PTransport)
    assert (transport.settings.datapath, transport.settings.write_into_weights) == ("shm", True)
    assert "trainer's host" in run.choices["transport"].reason
    cluster = MilesSettings(
        transport=TransportSpec(name="auto"),
        cluster={"launcher": {"name": "ray", "address": "10.0.0.1:6379"}},
    )
    run = build_run(cluster, manager, kinds=kinds)
    assert cluster.transport.name == "broadcast"
    assert "engines run on other hosts" in run.choices["transport"].reason
