"""The rollout-weight formats against torchao's own quantization: every part (values, scales) equals what
torchao's tensor subclass holds bit for bit, dequantizes to torchao's result, and the round-trip error is
the format's (fp8 ~2.7e-2, MXFP8 ~2.9e-2, NVFP4 ~9.5e-2 relative on a random bf16 matrix)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao", reason="torchao (miles-core[quant]) is not installed")

from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
from torchao.quantization.granularity import PerBlock, PerRow, PerTensor
from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

from miles.precision.formats import FORMATS, dequantize, get_format, keeps_dtype, quantize


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(256, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def _torchao_reference(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """torchao's parts and dequantized weight, straight from its tensor subclasses."""
    if name.startswith("fp8_"):
        granularity = {"fp8_tensor": PerTensor(), "fp8_row": PerRow(), "fp8_block": PerBlock([128, 128])}[name]
        t = Float8Tensor.from_hp(w, granularity=granularity)
        return {"": t.qdata, "_scale": t.scale}, t.dequantize(torch.bfloat16)
    if name == "mxfp8":
        mx = MXTensor.to_mx(w, torch.float8_e4m3fn, 32)
        return {"": mx.qdata, "_scale": mx.scale}, mx.dequantize(torch.bfloat16)
    nv = NVFP4Tensor.to_nvfp4(w, per_tensor_scale=per_tensor_amax_to_scale(w.abs().max().float()))
    return {"": nv.qdata, "_scale": nv.scale, "_scale_2": nv.per_tensor_scale}, nv.dequantize(torch.bfloat16)


EXPECTED = {
    # format: (values dtype, values shape, scale dtype, scale shape, relative round-trip error bound)
    "fp8_tensor": (torch.float8_e4m3fn, (256, 512), torch.float32, (1, 1), 0.03),
    "fp8_row": (torch.float8_e4m3fn, (256, 512), torch.float32, (256, 1), 0.03),
    "fp8_block": (torch.float8_e4m3fn, (256, 512), torch.float32, (2, 4), 0.03),
    "mxfp8": (torch.float8_e4m3fn, (256, 512), torch.float8_e8m0fnu, (256, 16), 0.035),
    "nvfp4": (torch.uint8, (256, 256), torch.float8_e4m3fn, (256, 32), 0.10),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_round_trip_equals_torchao(name: str, weight: torch.Tensor) -> None:
    fmt = get_format(name)
    parts = quantize(fmt, weight)
    values_dtype, values_shape, scale_dtype, scale_shape, bound = EXPECTED[name]
    assert (parts[""].dtype, tuple(parts[""].shape)) == (values_dtype, values_shape)
    assert (parts["_scale"].dtype, tuple(parts["_scale"].shape)) == (scale_dtype, scale_shape)
    reference, reference_dense = _torchao_reference(name, weight)
    for suffix, tensor in reference.items():  # the same bits as torchao's own parts
        assert torch.equal(parts[suffix].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    dense = dequantize(fmt, parts, torch.bfloat16)
    assert torch.equal(dense, reference_dense)
    error = float((dense.float() - weight.float()).norm() / weight.float().norm())
    assert 0.005 < error < bound, error
    # quantized parts and scales keep their dtype on the wire; high-precision weights take the engine's
    assert all(keeps_dtype("x.weight" + suffix, t) for suffix, t in parts.items())
    assert not keeps_dtype("x.weight", weight)


def test_nvfp4_per_tensor_scale_is_fp32_and_blocks_of_16() -> None:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * 1e-3
    parts = quantize(get_format("nvfp4"), w)
    assert parts["_scale_2"].dtype == torch.float32 and parts["_scale_2"].shape == (1,)
    assert float(parts["_scale_2"]) == pytest.approx(float(w.abs().max()) / (448.0 * 6.0), rel=1e-6)
    # each block of 16 values has its own scale: scaling one block changes only that scale
    w2 = w.clone()
    w2[0, :16] *= 0.5
    parts2 = quantize(get_format("nvfp4"), w2)
    changed = (parts2["_scale"].view(torch.uint8) != parts["_scale"].view(torch.uint8)).nonzero().tolist()
    assert changed == [[0, 0]]


def test_ragged_fp8_blocks_equal_torchao_on_the_zero_padded_weight() -> None:
    """SmolLM2's shapes (576 = 4.5 x 128): the last block of each dimension is partial, with its own scale
    (DeepSeek-V3 / SGLang block FP8); values and scales are torchao's on the weight padded with zeros."""
    fmt = get_format("fp8_block")
    g = torch.Generator().manual_seed(2)
    for rows, cols in [(576, 1536), (192, 576), (64, 128), (1, 5)]:
        w = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        parts = quantize(fmt, w)
        blocks = (-(-rows // 128), -(-cols // 128))
        assert parts[""].shape == (rows, cols) and parts["_scale"].shape == blocks
        padded = torch.zeros(blocks[0] * 128, blocks[1] * 128, dtype=w.dtype)
        padded[:rows, :cols] = w
        reference, reference_dense = _torchao_reference("fp8_block", padded)
        assert torch.equal(parts[""].view(torch.uint8), reference[""][:rows, :cols].view(torch.uint8))
        assert torch.equal(parts["_scale"], reference["_scale"].float())
        assert torch.equal(dequantize(fmt, parts, torch.bfloat16), reference_dense[:rows, :cols])


def test_shapes_that_do_not_fit_are_refused_by_name() -> None:
    fmt = get_format("fp8_block")
    assert fmt.fits((256, 128)) and fmt.fits((64, 128)) and not fmt.fits((128,)) and not fmt.fits((0, 128))
    mx = get_format("mxfp8")
    assert mx.fits((64, 128)) and not mx.fits((64, 48))
    with pytest.raises(ValueError, match=r"'mxfp8': shape \(64, 48\) does not split into \(1, 32\)"):
        quantize(mx, torch.zeros(64, 48))
    with pytest.raises(ValueError, match="unknown weight format 'fp6'.*fp8_block"):
        get_format("fp6")
