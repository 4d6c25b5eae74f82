"""The ``megatron`` plugin: entry point, registration, import cost, settings and layout checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.errors import SettingsError
from miles.testing.conformance import check_entry_point, check_light_import, check_plugin


def test_plugin_registers_the_megatron_trainer() -> None:
    import miles_megatron.plugin as plugin
    from miles_megatron.settings import MegatronSettings
    from miles_megatron.trainer import MegatronTrainer

    (entry,) = check_plugin(plugin, name="megatron", expect=[("trainer", "megatron")])
    assert entry.component is MegatronTrainer
    assert entry.settings_model is MegatronSettings


def test_entry_point_comes_from_the_miles_megatron_distribution() -> None:
    record = check_entry_point("megatron", distribution="miles-megatron")
    assert record.version == "0.1.0"
    assert ("trainer", "megatron") in record.registers


def test_plugin_trainer_and_settings_import_without_torch_or_megatron() -> None:
    for module in ("miles_megatron.plugin", "miles_megatron.trainer", "miles_megatron.settings"):
        check_light_import(module)
    code = "import sys, miles_megatron.trainer; assert not [m for m in sys.modules if m.startswith(('megatron', 'mbridge', 'torch'))]"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_miles_plugins_list_shows_trainer_megatron() -> None:
    miles = Path(sys.executable).with_name("miles")
    assert miles.exists(), f"the miles console script is not installed next to {sys.executable}"
    proc = subprocess.run(
        [str(miles), "plugins", "list", "--json"], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    megatron = next(p for p in json.loads(proc.stdout)["plugins"] if p["name"] == "megatron")
    assert megatron["distribution"] == "miles-megatron"
    assert megatron["status"] == "ok"
    assert {"kind": "trainer", "name": "megatron"} in megatron["registers"]
    assert megatron["commands"] == ["convert hf-to-megatron", "convert megatron-to-hf"]


def test_settings_reject_unknown_keys_and_bad_sizes() -> None:
    from pydantic import ValidationError

    from miles_megatron.settings import MegatronSettings

    with pytest.raises(ValidationError, match="tensor_paralel"):
        MegatronSettings.model_validate({"tensor_paralel": 2})
    with pytest.raises(ValidationError, match="pipeline_parallel"):
        MegatronSettings(pipeline_parallel=0)


CONFIG = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}


@pytest.mark.parametrize(
    ("options", "world", "config", "message"),
    [
        (
            {"tensor_parallel": 2, "pipeline_parallel": 2},
            2,
            CONFIG,
            "tensor_parallel x train.backend.pipeline_parallel",
        ),
        (
            {"tensor_parallel": 4},
            4,
            CONFIG,
            "train.backend.tensor_parallel = 4 does not divide the model's attention heads",
        ),
        ({"pipeline_parallel": 3}, 3, CONFIG, "train.backend.pipeline_parallel = 3 does not divide the model's layers"),
        ({"expert_parallel": 2}, 2, CONFIG, "train.backend.expert_parallel = 2 needs a mixture-of-experts model"),
        (
            {"expert_parallel": 3},
            3,
            {**CONFIG, "num_experts": 4},
            "expert_parallel = 3 does not divide the model's experts",
        ),
        (
            {"expert_parallel": 2},
            3,
            {**CONFIG, "num_experts": 4},
            "expert_parallel = 2 does not divide cluster.trainer_ranks",
        ),
        ({"sequence_parallel": True}, 1, CONFIG, "train.backend.sequence_parallel needs"),
        (
            {},
            1,
            {**CONFIG, "model_type": "gpt2"},
            "model_type 'gpt2' is not supported by the megatron trainer; supported: llama",
        ),
        (
            {},
            1,
            {**CONFIG, "model_type": "qwen2_5_vl", "vision_config": {"depth": 2}},
            "train.model_path: model_type 'qwen2_5_vl' is a vision-language model; the megatron trainer does not "
            "train vision-language models: mbridge 0.15.1 has no Qwen2-VL bridge",
        ),
    ],
)
def test_layout_errors_name_the_field(options: dict, world: int, config: dict, message: str) -> None:  # type: ignore[type-arg]
    from miles_megatron.settings import MegatronSettings, check_parallel_layout

    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_parallel_layout(MegatronSettings(**options), world, config)


def test_layout_ok_gives_the_data_parallel_size() -> None:
    from miles_megatron.settings import MegatronSettings, check_parallel_layout

    assert check_parallel_layout(MegatronSettings(tensor_parallel=2), 8, CONFIG) == 4
    assert check_parallel_layout(MegatronSettings(pipeline_parallel=2, tensor_parallel=2), 8, CONFIG) == 2


def test_the_settings_pass_checks_the_layout_before_anything_starts(tmp_path: Path) -> None:
    from miles.compose import build_run
    from miles.settings.loader import load_settings
    from miles.testing.models import build_tiny_model

    model = build_tiny_model(tmp_path / "m", "qwen2", seed=0)
    config = tmp_path / "run.toml"
    config.write_text(
        "[cluster]\ntrainer_ranks = 2\n[rollout]\nrollout_batch_size = 2\nn_samples_per_prompt = 2\n"
        f'[train]\nmodel_path = "{model}"\n[train.backend]\nname = "megatron"\npipeline_parallel = 4\n'
    )
    with pytest.raises(SettingsError, match="train.backend.tensor_parallel x train.backend.pipeline_parallel = 1 x 4"):
        build_run(load_settings(config))
    fine = load_settings(config, overrides=["train.backend.pipeline_parallel=1", "train.backend.tensor_parallel=2"])
    build_run(fine)
    refused = load_settings(config, overrides=["train.backend.pipeline_parallel=1", "train.true_on_policy=true"])
    with pytest.raises(SettingsError, match="train.true_on_policy: the megatron trainer does not implement it yet"):
        build_run(refused)
    replay = ["train.routing_replay=true", "train.backend.pipeline_parallel=2"]
    build_run(load_settings(config, overrides=replay))
    with pytest.raises(SettingsError, match="train.routing_replay with train.backend.recompute = 'full'"):
        build_run(load_settings(config, overrides=[*replay, "train.backend.recompute=full"]))


def test_bf16_with_checkpoints_is_refused_at_start_and_auto_takes_fp32_saying_why(tmp_path: Path) -> None:
    """Megatron-Core's distributed optimizer fails to save the optimizer state of bfloat16 parameters (its state
    tensors' sizes against the gradient buffer's ranges, ``AssertionError: (torch.Size([64]), 0, 32768)`` at the
    first save, after the steps it ran): refused before anything starts, and ``precision = "auto"`` (the default)
    takes float32 for the megatron trainer on a CPU with bfloat16 units, quoting the refusal."""
    from miles.compose import build_run
    from miles.defaults import MachineFacts
    from miles.settings.loader import load_settings
    from miles.testing.models import build_tiny_model

    model = build_tiny_model(tmp_path / "m", "qwen2", seed=0)
    config = tmp_path / "run.toml"
    config.write_text(
        "[cluster]\ntrainer_ranks = 1\n[rollout]\nrollout_batch_size = 2\nn_samples_per_prompt = 2\n"
        f'[train]\nmodel_path = "{model}"\n[train.backend]\nname = "megatron"\n'
    )
    bf16_units = MachineFacts(cpu_flags=frozenset({"avx512_bf16", "amx_bf16"}))
    with pytest.raises(SettingsError, match="precision: 'bf16' .* cannot save checkpoints yet"):
        build_run(load_settings(config, overrides=["precision=bf16"]))
    no_saves = ["precision=bf16", "checkpoint.save_final=false"]
    assert build_run(load_settings(config, overrides=no_saves))["precision"].registration.name == "bf16"
    with pytest.raises(SettingsError, match="precision: 'fp8' .* cannot save checkpoints yet"):
        build_run(load_settings(config, overrides=["precision=fp8", "checkpoint.save_interval=2"]))

    run = build_run(load_settings(config), machine=bf16_units)
    assert run["precision"].registration.name == "fp32"
    assert run.choices["precision"].reason.startswith("auto: bf16 refused by train.backend 'megatron': precision:")
    run = build_run(load_settings(config, overrides=["checkpoint.save_final=false"]), machine=bf16_units)
    assert run["precision"].registration.name == "bf16"  # nothing saved: bf16 trains


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_a_vision_language_model_is_refused_at_start_saying_why(tmp_path: Path, arch: str) -> None:
    """``miles train`` with the megatron trainer and a VLM stops in the settings check, naming the field and
    what mbridge lacks (before: the unsupported-family message, which did not say why); ``miles convert``'s
    bridge refuses it the same way."""
    from miles.compose import build_run
    from miles.settings.loader import load_settings
    from miles.testing.vlm import build_vl_tokenizer, tiny_vl_config
    from miles_megatron.bridge import build_bridge

    model = tmp_path / "vlm"
    tiny_vl_config(build_vl_tokenizer(), arch=arch).save_pretrained(model)  # type: ignore[arg-type]  # (its config is what is checked)
    config = tmp_path / "run.toml"
    config.write_text(
        "[rollout]\nrollout_batch_size = 2\nn_samples_per_prompt = 2\n"
        f'[train]\nmodel_path = "{model}"\n[train.backend]\nname = "megatron"\n'
    )
    why = rf"train.model_path: model_type '{arch}' is a vision-language model; .* TransformerEngine layers"
    with pytest.raises(SettingsError, match=why):
        build_run(load_settings(config))
    import torch
    from transformers import AutoConfig

    with pytest.raises(SettingsError, match=why):
        build_bridge(AutoConfig.from_pretrained(model), cpu=True, dtype=torch.float32, options=None, vocab_divisor=None)
