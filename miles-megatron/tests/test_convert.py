"""HF -> Megatron -> HF conversion: bit-identical per family, strict keys both ways, and the ``miles convert``
commands the plugin adds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import ENV, load_dir, run_script

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
    assert (
        "checkpoint does not match the model: missing key 'decoder.layers.self_attention.linear_qkv.bias'"
        in (errors["wrong_family"])
    )
    assert (
        "checkpoint does not match the model: 'decoder.layers.mlp.linear_fc1.layer_norm_weight' has shape [2, 64] "
        "in the checkpoint, [3, 64] in the model"
    ) in errors["wrong_depth"]


def miles_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The real ``miles`` console script next to this interpreter (plugins loaded from entry points)."""
    miles = Path(sys.executable).with_name("miles")
    full_env = {**os.environ, **ENV}
    return subprocess.run([str(miles), *args], env=full_env, capture_output=True, text=True, timeout=600)


def test_miles_convert_commands(converted: Path, tmp_path: Path) -> None:
    """``miles convert megatron-to-hf`` / ``hf-to-megatron`` come from the plugin's command hook, beside the
    core's ``miles convert gguf``: a converted checkpoint goes back to HF bit for bit; a key mismatch exits 1
    naming the first key, no traceback. (Both commands run the functions the in-process job checked.)"""
    models = converted / "models"
    with ThreadPoolExecutor(max_workers=2) as pool:
        back = pool.submit(
            miles_cli, "convert", "megatron-to-hf", str(converted / "out" / "qwen2" / "megatron"), str(tmp_path / "hf")
        )
        missing = pool.submit(miles_cli, "convert", "hf-to-megatron", str(models / "bad_missing"), str(tmp_path / "x"))
        back_proc, missing_proc = back.result(), missing.result()
    assert back_proc.returncode == 0, back_proc.stderr[-4000:]
    assert back_proc.stdout.strip().splitlines()[-1] == str(tmp_path / "hf")
    original, exported = load_dir(models / "qwen2"), load_dir(tmp_path / "hf")
    assert set(exported) == set(original) and all(torch.equal(exported[k], original[k]) for k in original)
    assert missing_proc.returncode == 1, missing_proc.stderr[-4000:]
    message = "weights do not match the model: missing key 'model.layers.1.mlp.down_proj.weight' (1 missing)"
    assert message in missing_proc.stderr and "Traceback" not in missing_proc.stderr, missing_proc.stderr[-4000:]
    assert not (tmp_path / "x" / "metadata.json").exists()


def test_module_entry_reports_a_bad_path(tmp_path: Path) -> None:
    proc = run_script(
        ["-m", "miles_megatron.convert", "megatron-to-hf", str(tmp_path / "nothing"), str(tmp_path / "x")]
    )
    assert proc.returncode == 1 and "not a Megatron distributed checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr
