"""The ``fp8`` / ``mxfp8`` / ``nvfp4`` recipes: registered beside ``fp32`` / ``bf16``, bf16 training over fp32
reduction, which weights they quantize (projections) and which stay high precision (embeddings, lm_head,
norms, biases, the MoE router), what a push carries and its bytes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao", reason="torchao (miles-core[quant]) is not installed")

import miles.precision.quantized
from miles.precision.quantized import FP8, MXFP8, NVFP4
from miles.testing import check_plugin, check_precision


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (512, 128),
        "model.layers.0.input_layernorm.weight": (128,),
        "model.layers.0.self_attn.q_proj.weight": (128, 128),
        "model.layers.0.self_attn.q_proj.bias": (128,),
        "model.layers.0.self_attn.k_proj.weight": (64, 128),
        "model.layers.0.mlp.gate.weight": (128, 128),
        "model.layers.0.mlp.experts.0.down_proj.weight": (128, 256),
        "model.layers.0.mlp.shared_expert_gate.weight": (1, 128),
        "model.norm.weight": (128,),
        "lm_head.weight": (512, 128),
    }
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def test_recipes_are_registered_and_pass_the_precision_check() -> None:
    expect = [("precision", "fp8"), ("precision", "mxfp8"), ("precision", "nvfp4")]
    check_plugin(miles.precision.quantized, name="quantized_precision", expect=expect)
    check_precision(FP8)
    check_precision(FP8, settings={"granularity": "row"})
    check_precision(MXFP8)
    check_precision(NVFP4)


@pytest.mark.parametrize(
    ("recipe", "engine", "quantized"),
    [
        (FP8(FP8.Settings()), "fp8_block", {"q_proj", "k_proj", "experts.0.down_proj"}),  # k_proj: ragged
        (FP8(FP8.Settings(granularity="row")), "fp8_row", {"q_proj", "k_proj", "experts.0.down_proj"}),
        (FP8(FP8.Settings(granularity="tensor")), "fp8_tensor", {"q_proj", "k_proj", "experts.0.down_proj"}),
        (MXFP8(MXFP8.Settings()), "mxfp8", {"q_proj", "k_proj", "experts.0.down_proj"}),
        (NVFP4(NVFP4.Settings()), "nvfp4", {"q_proj", "k_proj", "experts.0.down_proj"}),
    ],
)
def test_what_a_push_carries(recipe: FP8 | MXFP8 | NVFP4, engine: str, quantized: set[str]) -> None:
    assert (recipe.param_dtype, recipe.reduce_dtype, recipe.engine_quantization) == ("bfloat16", "float32", engine)
    weights = _weights()
    sent = dict(recipe.rollout_weights(iter(weights.items())))
    scaled = {n.removesuffix(".weight_scale") for n in sent if n.endswith(".weight_scale")}
    short = {n.removeprefix("model.layers.0.").removeprefix("self_attn.").removeprefix("mlp.") for n in scaled}
    assert short == quantized
    for name, tensor in weights.items():
        module = name.removesuffix(".weight")
        if module in scaled:
            assert sent[name].element_size() == 1  # fp8 values / two fp4 values per byte
        else:  # high precision, untouched (the transport casts it to the engine dtype)
            assert sent[name] is tensor and f"{module}.weight_scale" not in sent
    assert ("model.layers.0.self_attn.q_proj.weight_scale_2" in sent) == (engine == "nvfp4")
    # bytes of the quantized projections against bf16
    bf16 = sum(weights[f"{m}.weight"].numel() * 2 for m in scaled)
    pushed = sum(t.numel() * t.element_size() for n, t in sent.items() if n.rsplit(".", 1)[0] in scaled)
    ratio = pushed / bf16
    low, high = (0.25, 0.32) if engine == "nvfp4" else (0.5, 0.54)
    assert low < ratio < high, ratio
