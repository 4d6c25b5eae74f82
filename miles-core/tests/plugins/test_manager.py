from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import BaseModel

from miles.components import ComponentKind, ComponentSettings
from miles.errors import DuplicateComponentError, PluginLoadError, SettingsError, UnknownComponentError
from miles.plugins import PluginManager, hookimpl
from miles.plugins.builtin import BUILTIN_PLUGINS
from miles.settings import PluginSpec, load_settings

GOOD_REWARD = """
from miles.markers import hookimpl
from miles.rewards.base import Reward
from miles.components import ComponentSettings

class Settings(ComponentSettings):
    target: int = 3
    '''Target length.'''

class Shortness(Reward):
    '''Rewards short answers.'''
    name = "shortness"
    Settings = Settings
    async def score(self, sample):
        return float(len(sample.response_ids) <= self.settings.target)

@hookimpl
def miles_register_rewards(register):
    register(Shortness)
"""

BROKEN = """
raise ImportError("No module named 'flash_attn_9000'")
"""


def _manager(**kwargs: object) -> PluginManager:
    return PluginManager(entry_points=False, **kwargs).load()  # type: ignore[arg-type]


def test_builtins_load_and_register_through_hooks() -> None:
    pm = _manager()
    records = {r.name: r for r in pm.records()}
    for name, _module in BUILTIN_PLUGINS:
        assert records[name].status == "ok", records[name].error
        assert records[name].builtin and records[name].distribution == "miles-core"
    assert ("precision", "fp32") in records["precision"].registers
    assert pm.get(ComponentKind.PRECISION, "bf16").component.param_dtype == "bfloat16"


class _DupTrainerA:
    @hookimpl
    def miles_register_precisions(self, register: Callable[..., None]) -> None:
        class Other:
            """Claims a name the built-ins own."""

            name = "fp32"

        register(Other)


def test_duplicate_name_is_an_error_naming_both_plugins() -> None:
    pm = _manager()
    pm.register(_DupTrainerA(), "dup-plugin")
    record = {r.name: r for r in pm.records()}["dup-plugin"]
    assert record.status == "failed"
    assert "'precision'" in record.error and "'dup-plugin'" in record.error  # type: ignore[operator]
    with pytest.raises(
        DuplicateComponentError,
        match="precision 'fp32' is registered by both plugin 'precision' and plugin 'dup-plugin'",
    ):
        pm.get(ComponentKind.PRECISION, "fp32")
    pm.unregister("dup-plugin")
    assert pm.get(ComponentKind.PRECISION, "fp32").plugin == "precision"


def test_builtins_are_blockable_by_name() -> None:
    pm = _manager(disabled=["jsonl"])
    record = {r.name: r for r in pm.records()}["jsonl"]
    assert record.status == "blocked" and "MILES_DISABLE_PLUGINS" in (record.error or "")
    assert "jsonl" not in pm.registry(ComponentKind.LOGGER)


def test_disable_env_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_DISABLE_PLUGINS", "precision, jsonl")
    pm = PluginManager(entry_points=False).load()
    statuses = {r.name: r.status for r in pm.records()}
    assert statuses["precision"] == statuses["jsonl"] == "blocked"
    assert {s for name, s in statuses.items() if name not in ("precision", "jsonl")} == {"ok"}


def test_unknown_hook_fails_the_plugin() -> None:
    class Typo:
        @hookimpl
        def miles_register_reward(self, register: Callable[..., None]) -> None:  # missing "s"
            raise AssertionError("never called")

    pm = _manager()
    with pytest.raises(PluginLoadError, match="unknown hook.*miles_register_reward"):
        pm.register(Typo(), "typo")


def test_registration_hook_that_raises_is_recorded() -> None:
    class Raises:
        @hookimpl
        def miles_register_rewards(self, register: Callable[..., None]) -> None:
            raise RuntimeError("reward model file missing")

    pm = _manager()
    pm.register(Raises(), "raiser")
    record = {r.name: r for r in pm.records()}["raiser"]
    assert record.status == "failed"
    assert record.error == "miles_register_rewards: RuntimeError: reward model file missing"


def test_invalid_component_name_is_rejected() -> None:
    class BadName:
        @hookimpl
        def miles_register_rewards(self, register: Callable[..., None]) -> None:
            register(object(), name="Not A Name")

    pm = _manager()
    pm.register(BadName(), "badname")
    record = {r.name: r for r in pm.records()}["badname"]
    assert record.status == "failed"
    assert "plugin 'badname' registered a reward with an invalid name 'Not A Name'" in (record.error or "")
    assert len(pm.registry(ComponentKind.REWARD)) == 0 or "Not A Name" not in pm.registry(ComponentKind.REWARD)


def test_entry_point_plugins_load_and_failures_are_recorded(fake_distribution: Callable[..., Path]) -> None:
    fake_distribution(
        "miles-shortness", {"shortness": "miles_shortness_plugin"}, {"miles_shortness_plugin": GOOD_REWARD}
    )
    fake_distribution(
        "miles-broken", {"broken": "miles_broken_plugin"}, {"miles_broken_plugin": BROKEN}, version="2.0.0"
    )
    pm = PluginManager().load()
    records = {r.name: r for r in pm.records()}
    assert records["shortness"].status == "ok"
    assert records["shortness"].distribution == "miles-shortness" and records["shortness"].version == "0.3.1"
    assert records["shortness"].registers == [("reward", "shortness")]
    broken = records["broken"]
    assert (broken.status, broken.distribution, broken.version) == ("failed", "miles-broken", "2.0.0")
    assert broken.error == "ImportError: No module named 'flash_attn_9000'"
    assert "miles_broken_plugin" in (broken.traceback or "")
    # a run that needs what the broken plugin provides stops with a message naming it
    with pytest.raises(
        PluginLoadError,
        match=r"(?s)reward 'broken' is not available.*plugin 'broken' \(miles-broken 2.0.0\) failed to load: ImportError",
    ):
        pm.get(ComponentKind.REWARD, "broken", field="reward.functions[0]")


def test_load_env_selects_entry_point_plugins(
    fake_distribution: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_distribution(
        "miles-shortness", {"shortness": "miles_shortness_plugin"}, {"miles_shortness_plugin": GOOD_REWARD}
    )
    fake_distribution("miles-broken", {"broken": "miles_broken_plugin"}, {"miles_broken_plugin": BROKEN})
    monkeypatch.setenv("MILES_LOAD_PLUGINS", "shortness")
    records = {r.name: r for r in PluginManager().records()}
    assert records["shortness"].status == "ok"
    assert records["broken"].status == "blocked" and records["broken"].error == "not listed in MILES_LOAD_PLUGINS"
    monkeypatch.setenv("MILES_LOAD_PLUGINS", "")
    records = {r.name: r for r in PluginManager().records()}
    assert records["shortness"].status == "blocked"


def test_same_plugin_name_from_two_distributions(fake_distribution: Callable[..., Path]) -> None:
    fake_distribution(
        "miles-shortness", {"shortness": "miles_shortness_plugin"}, {"miles_shortness_plugin": GOOD_REWARD}
    )
    fake_distribution("miles-shortness-fork", {"shortness": "miles_shortness_plugin"}, {})
    records = PluginManager().records()
    clash = [r for r in records if r.distribution == "miles-shortness-fork"]
    assert len(clash) == 1 and clash[0].status == "failed"
    assert "already taken by distribution 'miles-shortness'" in (clash[0].error or "")


def test_resolve_validates_component_settings_and_names_the_field() -> None:
    class Opts(ComponentSettings):
        depth: int = 2
        """How deep."""

    class Deep:
        """A test logger."""

        name = "deep"
        Settings = Opts

        def __init__(self, settings: BaseModel, *, run_dir: str) -> None:
            self.settings, self.run_dir = settings, run_dir

    class Plugin:
        @hookimpl
        def miles_register_loggers(self, register: Callable[..., None]) -> None:
            register(Deep)

    pm = _manager()
    pm.register(Plugin(), "deep-plugin")
    logger = pm.create(ComponentKind.LOGGER, PluginSpec(name="deep", depth=5), field="log.loggers[0]", run_dir="/tmp/x")
    assert isinstance(logger, Deep) and logger.settings.depth == 5  # type: ignore[attr-defined]
    with pytest.raises(SettingsError, match=r"log.loggers\[0\].dept: unknown key"):
        pm.resolve(ComponentKind.LOGGER, PluginSpec(name="deep", dept=5), field="log.loggers[0]")
    with pytest.raises(SettingsError, match=r"log.loggers\[0\].depth: Input should be a valid integer"):
        pm.resolve(ComponentKind.LOGGER, PluginSpec(name="deep", depth="x"), field="log.loggers[0]")
    with pytest.raises(
        UnknownComponentError,
        match=r"log.loggers\[0\]: unknown logger 'deeep' \(available: deep, jsonl, tensorboard, wandb\)",
    ):
        pm.resolve(ComponentKind.LOGGER, PluginSpec(name="deeep"), field="log.loggers[0]")


def test_validate_settings_names_field_and_file_line(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[cluster]\ndevice = "cpu"\n\n[precision]\nname = "bf16"\nscale = 2\n')
    settings = load_settings(config)
    pm = _manager()
    with pytest.raises(SettingsError) as info:
        pm.resolve(
            ComponentKind.PRECISION,
            settings.precision,
            field="precision",
            source_of=lambda p: {"precision.scale": f"{config}:6"}.get(p),
        )
    assert f"precision.scale ({config}:6): unknown key" in str(info.value)


def test_lifecycle_hooks_reach_plugins(tmp_path: Path) -> None:
    seen: list[tuple[str, object]] = []

    class Observer:
        @hookimpl
        def miles_on_step_end(self, step: int, metrics: dict[str, float]) -> None:
            seen.append(("step", (step, dict(metrics))))

        @hookimpl
        def miles_on_checkpoint_saved(self, path: str) -> None:  # opts into one argument only
            seen.append(("ckpt", path))

    pm = _manager()
    pm.register(Observer(), "observer")
    pm.on_step_end(step=3, metrics={"reward/mean": 0.5})
    pm.on_checkpoint_saved(step=3, path=str(tmp_path))
    assert seen == [("step", (3, {"reward/mean": 0.5})), ("ckpt", str(tmp_path))]


def test_cli_lists_broken_plugin_and_keeps_working(fake_distribution: Callable[..., Path]) -> None:
    fake_distribution("miles-broken", {"broken": "miles_broken_plugin"}, {"miles_broken_plugin": BROKEN})
    out = subprocess.run(
        [sys.executable, "-m", "miles", "plugins", "list", "--json"], capture_output=True, text=True, check=True
    )
    data = json.loads(out.stdout)
    assert data["schema_version"] == 1
    broken = next(p for p in data["plugins"] if p["name"] == "broken")
    assert broken["status"] == "failed" and "flash_attn_9000" in broken["error"]
    table = subprocess.run(
        [sys.executable, "-m", "miles", "plugins", "list"], capture_output=True, text=True, check=True
    )
    assert "broken" in table.stdout and "failed" in table.stdout and "precision: fp32" in table.stdout
