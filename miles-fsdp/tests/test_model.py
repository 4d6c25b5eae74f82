"""Model loading without a process group: from weights, from a bare config, the critic, the layers FSDP wraps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.testing.models import build_tiny_model
from miles_fsdp.model import ValueModel, decoder_layers, load_causal_lm, load_value_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "m", "qwen2", seed=5)


def test_loads_weights_from_a_safetensors_directory(model_dir: Path) -> None:
    from safetensors.torch import load_file

    model = load_causal_lm(str(model_dir), seed=0, attn_implementation="sdpa")
    saved = load_file(str(model_dir / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert [type(layer).__name__ for layer in decoder_layers(model)] == ["Qwen2DecoderLayer"] * 2


def test_builds_from_a_bare_config_with_the_seed(model_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((model_dir / "config.json").read_text())
    a = load_causal_lm(str(bare), seed=11, attn_implementation="sdpa").state_dict()
    b = load_causal_lm(str(bare), seed=11, attn_implementation="sdpa").state_dict()
    c = load_causal_lm(str(bare), seed=12, attn_implementation="sdpa").state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])


def test_missing_model_path_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="train.model_path"):
        load_causal_lm(str(tmp_path), seed=0, attn_implementation="sdpa")


def test_value_model_scores_every_position(model_dir: Path) -> None:
    critic = load_value_model(str(model_dir), seed=0, attn_implementation="sdpa", init_std=0.02)
    assert isinstance(critic, ValueModel)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (1, 9))
    values = critic(ids, torch.arange(9)[None])
    assert values.shape == (1, 9) and values.dtype == torch.float32 and values.abs().sum() > 0
    zero = load_value_model(str(model_dir), seed=0, attn_implementation="sdpa", init_std=0.0)
    assert torch.equal(zero(ids, torch.arange(9)[None]), torch.zeros(1, 9))
