"""The local engine's quantized projections (``--quantization``): they hold exactly what a recipe pushes,
compute with it — ``torch._scaled_mm`` for per-row / per-tensor FP8, torchao's dequantization then a matmul
otherwise — say which once, and a format the engine cannot run is refused naming it."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchao", reason="torchao (miles-core[quant]) is not installed")

from miles.engine.model_runner import ModelRunner
from miles.engine.quantized import QuantizedLinear, quantize_model
from miles.engine.weight_sync import weights_checksum
from miles.precision.formats import dequantize, get_format
from miles.precision.quantized import FP8, MXFP8, NVFP4, QuantizedRecipe
from miles.transport.base import wire_dtype
from miles.transport.verify import compare_checksums, tensor_checksum

RECIPES: dict[str, QuantizedRecipe] = {  # type: ignore[type-arg]
    "fp8_block": FP8(FP8.Settings()),
    "fp8_row": FP8(FP8.Settings(granularity="row")),
    "fp8_tensor": FP8(FP8.Settings(granularity="tensor")),
    "mxfp8": MXFP8(MXFP8.Settings()),
    "nvfp4": NVFP4(NVFP4.Settings()),
}
PROMPT = [[3, 17, 42, 99, 7, 64, 5, 11]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(
        tmp_path_factory.mktemp("quant-model") / "llama", "llama", seed=0, hidden_size=128, intermediate_size=256
    )


@pytest.fixture(scope="module")
def trainer_weights(llama: Path) -> dict[str, torch.Tensor]:
    """The "trainer's" fp32 weights: the checkpoint moved a little (a push must overwrite the engine's)."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(5)
    return {
        n: t + 0.002 * torch.randn(t.shape, generator=g) for n, t in load_file(str(llama / "model.safetensors")).items()
    }


def _logprobs(runner: ModelRunner) -> torch.Tensor:
    logits, _ = runner.prefill(0, PROMPT, [0], [True])
    assert logits[0] is not None
    return torch.log_softmax(logits[0], dim=-1)


@pytest.mark.parametrize("fmt", list(RECIPES))
def test_the_engine_holds_the_push_and_computes_with_it(
    fmt: str, llama: Path, trainer_weights: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    recipe = RECIPES[fmt]
    with caplog.at_level(logging.INFO, logger="miles.engine.quantized"):
        runner = ModelRunner(llama, dtype="bfloat16", attention_backend="sdpa", quantization=fmt)
    how = "torch._scaled_mm" if fmt in ("fp8_row", "fp8_tensor") else "dequantize-then-matmul"
    said = [r.getMessage() for r in caplog.records if "compute by" in r.getMessage()]
    assert len(said) == 1 and how in said[0] and f"quantization {fmt!r}" in said[0]

    sent = dict(recipe.rollout_weights(iter(trainer_weights.items())))
    assert runner.load_tensors(sent.items(), source="push") == len(sent)
    # what the engine holds is what was pushed, bit for bit (what verification checks)
    report = weights_checksum(runner.model)
    wire = {n: tensor_checksum(t.to(wire_dtype(n, t, torch.bfloat16))) for n, t in sent.items()}
    compare_checksums(wire, report["checksums"], engine=fmt, aliases=report["aliases"])
    layers = runner.model.model.layers
    assert isinstance(layers[1].mlp.down_proj, QuantizedLinear)
    assert type(layers[1].input_layernorm.weight) is torch.nn.Parameter
    assert layers[0].mlp.down_proj.weight.element_size() == 1

    # each projection computes with the quantized weight
    proj: QuantizedLinear = layers[1].mlp.down_proj
    x = torch.randn(5, proj.in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    parts = {"": proj.weight, "_scale": proj.weight_scale}
    if fmt == "nvfp4":
        parts["_scale_2"] = proj.weight_scale_2
    dense = dequantize(get_format(fmt), parts, torch.float32)
    with torch.inference_mode():
        got = proj(x).float()
    if proj.use_scaled_mm:  # W8A8: the activations quantized per token / per tensor, fp32 accumulation
        rowwise = fmt == "fp8_row"
        amax = x.float().abs().amax(dim=1, keepdim=True) if rowwise else x.float().abs().amax()
        xs = amax / 448.0
        xq = (x.float() / xs).to(torch.float8_e4m3fn).float() * xs
        want = xq @ dense.t()
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-3), float((got - want).abs().max())
        assert not torch.equal(got, (x.float() @ dense.t()).to(torch.bfloat16).float())  # activations quantized too
    else:  # weight-only: exactly F.linear over torchao's dequantized weight (prepacked where the engine packs)
        assert bool(proj.pack) == runner.pack_weights
        assert torch.equal(got, F.linear(x, dense.to(torch.bfloat16)).float())

    # the model's logprobs: near a bf16 engine's on the same weights, and not equal to them
    reference = ModelRunner(llama, dtype="bfloat16", attention_backend="sdpa")
    reference.load_tensors(trainer_weights.items())
    diff = (_logprobs(runner).exp() * (_logprobs(runner) - _logprobs(reference))).sum(-1).abs()
    bound = 0.05 if fmt == "nvfp4" else 0.01
    assert 0 < float(diff.max()) < bound, float(diff.max())


def test_a_second_push_replaces_the_dequantized_weights(llama: Path, trainer_weights: dict[str, torch.Tensor]) -> None:
    runner = ModelRunner(llama, dtype="bfloat16", attention_backend="sdpa", quantization="mxfp8")
    recipe = RECIPES["mxfp8"]
    runner.load_tensors(recipe.rollout_weights(iter(trainer_weights.items())))
    first = _logprobs(runner)
    moved = {n: t * 1.5 if "proj" in n else t for n, t in trainer_weights.items()}
    runner.load_tensors(recipe.rollout_weights(iter(moved.items())))
    assert (first - _logprobs(runner)).abs().max() > 1e-3  # the cached dense weights were rebuilt
    runner.load_tensors(recipe.rollout_weights(iter(trainer_weights.items())))
    assert torch.equal(first, _logprobs(runner))


def test_formats_the_engine_cannot_run_are_refused(
    tmp_path: Path, llama: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from miles.testing.models import build_tiny_model

    small = build_tiny_model(tmp_path / "small", "llama", hidden_size=48, intermediate_size=80)  # no 32 divides
    with pytest.raises(ValueError, match=r"quantization 'mxfp8': no projection weight of the model splits"):
        ModelRunner(small, dtype="bfloat16", attention_backend="sdpa", quantization="mxfp8")
    from miles.precision import formats

    formats.require_torchao.cache_clear()
    monkeypatch.setitem(sys.modules, "torchao.prototype.mx_formats.nvfp4_tensor", None)  # torchao absent
    try:
        with pytest.raises(ValueError, match=r"quantization 'nvfp4' needs torchao and numpy \(pip install"):
            quantize_model(torch.nn.Sequential(torch.nn.Linear(32, 32)), "nvfp4")
    finally:
        monkeypatch.undo()
        formats.require_torchao.cache_clear()
    from miles.engine.options import parse_serve_args

    with pytest.raises(SystemExit) as exit_info:
        parse_serve_args(["--model", str(llama), "--quantization", "int3"])
    assert exit_info.value.code == 2 and "argument --quantization: invalid choice: 'int3'" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8", "nvfp4"])
def test_dequantized_projections_fuse_like_the_bf16_ones_bit_for_bit(fmt: str, llama: Path) -> None:
    """q/k/v and gate/up of the emulated formats run as one prepacked matmul each (the bf16 engine's fusion),
    with the same logits bit for bit as the projections one by one."""
    runner = ModelRunner(llama, dtype="bfloat16", attention_backend="sdpa", quantization=fmt)
    if not runner.pack_weights:
        pytest.skip("this CPU has no oneDNN bf16 weight packing")
    groups = runner._dequantized_qkv + runner._dequantized_gate_up
    assert len(groups) == 2 * len(runner.layers) and all(g is not None for g in groups)
    fused = _logprobs(runner)
    runner._dequantized_qkv = [None] * len(runner.layers)
    runner._dequantized_gate_up = [None] * len(runner.layers)
    assert torch.equal(fused, _logprobs(runner))
