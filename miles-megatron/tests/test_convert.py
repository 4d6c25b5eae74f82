"""HF -> Megatron -> HF conversion: bit-identical per family, strict keys, and the command line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import load_dir, run_script

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

FAMILIES = {
    "llama": dict(tie_word_embeddings=True),
    "qwen2": {},
    "qwen3": {},
    "qwen2_moe": {},
    "qwen3_moe": {},
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import load_file, save_file

    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("convert")
    for i, (arch, kwargs) in enumerate(FAMILIES.items()):
        build_tiny_model(root / "models" / arch, arch, seed=10 + i, **kwargs)  # type: ignore[arg-type]
    for name, edit in (("bad_missing", "drop"), ("bad_unexpected", "add")):
        bad = root / "models" / name
        shutil.copytree(root / "models" / "qwen2", bad)
        weights = load_file(str(bad / "model.safetensors"))
        if edit == "drop":
            del weights["model.layers.1.mlp.down_proj.weight"]
        else:
            weights["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
        save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    proc = run_script([str(Path(__file__).with_name("convert_job.py")), str(root / "models"), str(root / "out")])
    assert proc.returncode == 0, proc.stderr[-6000:]
    return root


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_round_trip_is_bit_identical_and_reloads_strict(converted: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    original = load_dir(converted / "models" / arch)
    back = load_dir(converted / "out" / arch / "hf")
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(converted / "out" / arch / "hf", dtype=torch.float32)
    state = model.state_dict()
    assert json.loads((converted / "out" / arch / "megatron" / "trainer_state.json").read_text())["model_only"]
    assert state  # loaded without missing / unexpected keys (transformers raises on neither; checked above)


def test_strict_keys_name_the_first_missing_and_unexpected_key(converted: Path) -> None:
    errors = json.loads((converted / "out" / "errors.json").read_text())
    assert "missing key 'model.layers.1.mlp.down_proj.weight'" in errors["bad_missing"]
    assert "unexpected key 'model.layers.0.mlp.extra.weight'" in errors["bad_unexpected"]


def test_command_line_entry_converts(converted: Path, tmp_path: Path) -> None:
    src = converted / "models" / "qwen2"
    proc = run_script(["-m", "miles_megatron.convert", "hf-to-megatron", str(src), str(tmp_path / "m")])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "m" / "metadata.json").exists() and (tmp_path / "m" / "hf" / "config.json").exists()
    proc = run_script(
        ["-m", "miles_megatron.convert", "megatron-to-hf", str(tmp_path / "nothing"), str(tmp_path / "x")]
    )
    assert proc.returncode != 0 and "not a Megatron distributed checkpoint" in proc.stderr
