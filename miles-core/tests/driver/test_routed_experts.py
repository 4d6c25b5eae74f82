"""Which runs ask the engines for routed experts: MoE policies on an engine that reports them."""

from __future__ import annotations

from pathlib import Path

from miles.compose import ROLLOUT_KINDS, build_run
from miles.engine.plugin import LocalEngine
from miles.plugins.manager import PluginManager
from miles.rollout.backend import EngineCapabilities
from miles.settings.loader import load_settings
from miles.settings.model import MilesSettings
from miles.testing.models import build_tiny_model
from miles.testing.plugins import registering


class NoExperts(LocalEngine):
    """The local engine, as if it could not report routed experts."""

    name = "no_experts"
    capabilities = EngineCapabilities(routed_experts=False)


def settings_for(tmp_path: Path, arch: str, *overrides: str) -> MilesSettings:
    model = build_tiny_model(tmp_path / arch, arch, seed=0)  # type: ignore[arg-type]
    config = tmp_path / f"{arch}.toml"
    config.write_text(f'[train]\nmodel_path = "{model}"\n')
    return load_settings(config, overrides=list(overrides))


def test_moe_runs_record_routed_experts_where_the_engine_reports_them(tmp_path: Path) -> None:
    # the rollout side only: miles-core's own tests run without a trainer backend installed
    assert build_run(settings_for(tmp_path, "qwen3_moe"), kinds=ROLLOUT_KINDS).records_routed_experts
    assert not build_run(settings_for(tmp_path, "qwen2"), kinds=ROLLOUT_KINDS).records_routed_experts
    pm = PluginManager().load()
    pm.register(registering("miles_register_rollout_engines", NoExperts), name="no-experts")
    try:
        moe = settings_for(tmp_path, "qwen3_moe", "rollout.engine.name=no_experts", "train.routing_replay=true")
        assert not build_run(moe, pm, kinds=ROLLOUT_KINDS).records_routed_experts
    finally:
        pm.unregister("no-experts")
