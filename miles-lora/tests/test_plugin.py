"""The ``lora`` plugin through the plugin manager: its adapter and transport are discovered, their settings
validated with the field named, and the composition root wires the adapter into the trainer (fsdp, megatron)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.components import ComponentKind
from miles.errors import SettingsError
from miles.plugins.manager import PluginManager
from miles.settings.model import MilesSettings, PluginSpec


def test_adapter_and_transport_are_registered_with_typed_settings() -> None:
    from miles_lora.adapter import LoraAdapter
    from miles_lora.settings import LoraSettings
    from miles_lora.transport import LoraTransport

    pm = PluginManager().load()
    assert pm.get(ComponentKind.ADAPTER, "lora").component is LoraAdapter
    assert pm.get(ComponentKind.TRANSPORT, "lora").component is LoraTransport
    _, options = pm.resolve(ComponentKind.ADAPTER, PluginSpec(name="lora", r=16), field="train.adapter")
    assert isinstance(options, LoraSettings) and options.r == 16 and options.alpha == 16
    with pytest.raises(SettingsError, match=r"train\.adapter\.r"):
        pm.resolve(ComponentKind.ADAPTER, PluginSpec(name="lora", r=0), field="train.adapter")


def test_build_run_gives_the_fsdp_trainer_its_adapter(tmp_path: Path) -> None:
    from miles_lora.adapter import LoraAdapter

    from miles.compose import build_run
    from miles.testing.models import build_tiny_model
    from miles.training.trainer import DistContext

    model = build_tiny_model(tmp_path / "model", "qwen2", seed=0)
    settings = MilesSettings.model_validate(
        {"train": {"model_path": str(model), "adapter": {"name": "lora", "r": 2}}, "transport": {"name": "lora"}}
    )
    run = build_run(settings)
    trainer = run.trainer(DistContext())
    assert isinstance(trainer.adapter, LoraAdapter) and trainer.adapter.settings.r == 2
    peft = trainer.adapter.peft_config()
    assert peft.r == 2 and peft.lora_alpha == 16 and set(peft.target_modules) >= {"q_proj", "down_proj"}


def test_build_run_gives_the_megatron_trainer_its_adapter(tmp_path: Path) -> None:
    from miles_lora.adapter import LoraAdapter

    from miles.compose import build_run
    from miles.testing.models import build_tiny_model
    from miles.training.trainer import DistContext

    model = build_tiny_model(tmp_path / "model", "qwen2", seed=0)
    settings = MilesSettings.model_validate(
        {
            "train": {"model_path": str(model), "backend": {"name": "megatron"}, "adapter": {"name": "lora", "r": 2}},
            "transport": {"name": "lora"},
        }
    )
    trainer = build_run(settings).trainer(DistContext())
    assert trainer.name == "megatron" and isinstance(trainer.adapter, LoraAdapter)
    spec = trainer.adapter.low_rank()
    assert spec.r == 2 and spec.scaling == 8.0 and "q_proj" in spec.target_modules
