"""Low-precision weight formats of rollout weights, on torchao's tensor subclasses.

A quantized weight travels as plain tensors, each a safetensors tensor under its own name beside the
weight's HF name ``<module>.weight``:

=============  ===========================  ================================  ==========================
format         ``<module>.weight``          ``<module>.weight_scale``         ``<module>.weight_scale_2``
=============  ===========================  ================================  ==========================
``fp8_tensor`` float8_e4m3fn ``[out, in]``  float32 ``[1, 1]`` (dequant mul)  --
``fp8_row``    float8_e4m3fn ``[out, in]``  float32 ``[out, 1]``              --
``fp8_block``  float8_e4m3fn ``[out, in]``  float32 ``[⌈out/128⌉, ⌈in/128⌉]``   --
``mxfp8``      float8_e4m3fn ``[out, in]``  float8_e8m0fnu ``[out, in/32]``   --
``nvfp4``      uint8 ``[out, in/2]`` (2     float8_e4m3fn ``[out, in/16]``    float32 ``[1]`` (per tensor)
               e2m1 values per byte)
=============  ===========================  ================================  ==========================

Scales multiply: ``weight ~= qdata * scale`` (broadcast per block), as torchao stores them. FP8 blocks
may be ragged, as in DeepSeek-V3's checkpoints and SGLang's block FP8: the last block of a dimension that
is not a multiple of 128 is partial and has its own scale (SmolLM2's hidden size is 576 = 4.5 x 128). The
packing, the scale rounding (MX: e8m0 floor; NVFP4: e4m3 block scales under a per-tensor fp32 scale)
and the dequantization are torchao's (``Float8Tensor``, ``MXTensor``, ``NVFP4Tensor``); this module only
names their parts. torchao is an optional dependency: ``pip install "miles-core[quant]"``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.components import Requirement

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMATS",
    "FP8_MAX",
    "HIGH_PRECISION",
    "TORCHAO",
    "WeightFormat",
    "dequantize",
    "get_format",
    "keeps_dtype",
    "quantize",
    "quantizes",
    "require_torchao",
]

TORCHAO = Requirement("torchao", extra="quant")
"""What the formats need: torchao's tensor subclasses (:mod:`miles.precision.quantized`'s recipes declare it)."""
FP8_MAX = 448.0
"""The largest float8_e4m3fn value (``torch.finfo(torch.float8_e4m3fn).max``)."""
SCALE = "_scale"
"""Suffix (after ``weight``) of the block / row / tensor scales."""
GLOBAL_SCALE = "_scale_2"
"""Suffix of NVFP4's per-tensor fp32 scale."""


def keeps_dtype(name: str, tensor: torch.Tensor) -> bool:
    """Whether a rollout tensor travels and is served in its own dtype rather than the engine dtype: the
    quantized values (1-byte or integer dtypes) and the scales of a format."""
    return (
        tensor.element_size() == 1
        or not tensor.is_floating_point()
        or name.endswith(("weight" + SCALE, "weight" + GLOBAL_SCALE))
    )


@dataclass(frozen=True)
class WeightFormat:
    """One low-precision weight format."""

    name: str
    """Engine name (``rollout.engine.quantization``)."""
    block: tuple[int, int]
    """Rows x columns one scale covers (``0``: the whole dimension)."""
    description: str
    """What the format is, for logs and docs."""
    ragged: bool = False
    """Whether the last block of a dimension may be partial (then it has its own scale)."""

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a 2-D weight of ``shape`` splits into scale blocks (whole ones unless :attr:`ragged`)."""
        if len(shape) != 2 or min(shape) < 1:
            return False
        if self.ragged:
            return True
        return all(b == 0 or (n % b == 0 and n >= b) for n, b in zip(shape, self.block, strict=True))


FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("fp8_tensor", (0, 0), "FP8 e4m3, one fp32 scale per tensor"),
        WeightFormat("fp8_row", (1, 0), "FP8 e4m3, one fp32 scale per output row"),
        WeightFormat("fp8_block", (128, 128), "FP8 e4m3, fp32 scales per 128x128 block (DeepSeek-V3)", ragged=True),
        WeightFormat("mxfp8", (1, 32), "MXFP8 (OCP MX): FP8 e4m3, e8m0 scales per block of 32"),
        WeightFormat("nvfp4", (1, 16), "NVFP4: FP4 e2m1, e4m3 scales per block of 16, fp32 tensor scale"),
    )
}


HIGH_PRECISION = re.compile(r"(embed|lm_head|norm|(^|\.)mlp\.gate\.|shared_expert_gate|router)")
"""Names of weights that stay high precision whatever their shape."""


def quantizes(fmt: WeightFormat, name: str, shape: tuple[int, ...]) -> bool:
    """Whether the weight ``name`` of ``shape`` travels and is served in ``fmt`` (else high precision): the one
    rule the trainer and the engine share."""
    return name.endswith(".weight") and not HIGH_PRECISION.search(name) and fmt.fits(shape)


def get_format(name: str) -> WeightFormat:
    """The format called ``name``; an unknown one is a ``ValueError`` listing the known ones."""
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r} (known: {', '.join(FORMATS)})")
    return FORMATS[name]


@functools.cache
def require_torchao(what: str) -> None:
    """Import torchao's formats or raise ``RuntimeError`` saying ``what`` needs them."""
    try:
        import numpy  # noqa: F401  (mx_formats needs it without declaring it)
        import torchao.prototype.mx_formats.nvfp4_tensor
        import torchao.quantization.quantize_.workflows.float8.float8_tensor  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"{what} needs torchao and numpy ({TORCHAO.install}): {exc}") from None


def _fp8_granularity(fmt: WeightFormat) -> Any:
    from torchao.quantization.granularity import PerBlock, PerRow, PerTensor

    if fmt.name == "fp8_tensor":
        return PerTensor()
    if fmt.name == "fp8_row":
        return PerRow()
    return PerBlock(list(fmt.block))


def quantize(fmt: WeightFormat, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{suffix: tensor}`` of ``weight`` (2-D, fitting the format's blocks) in ``fmt``: ``""`` the
    quantized values, ``"_scale"`` the scales, ``"_scale_2"`` NVFP4's per-tensor scale."""
    require_torchao(f"weight format {fmt.name!r}")
    if not fmt.fits(tuple(weight.shape)):
        raise ValueError(
            f"weight format {fmt.name!r}: shape {tuple(weight.shape)} does not split into {fmt.block} blocks"
        )
    w = weight.detach().contiguous()
    if fmt.name.startswith("fp8_"):
        from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

        rows, cols = w.shape
        padded = _pad_to_blocks(fmt, w)  # zeros leave every block's amax, hence its scale, as it is
        t = Float8Tensor.from_hp(padded, granularity=_fp8_granularity(fmt))
        qdata = t.qdata[:rows, :cols].contiguous() if padded is not w else t.qdata
        return {"": qdata, SCALE: t.scale.float().reshape(_fp8_scale_shape(fmt, (rows, cols)))}
    if fmt.name == "mxfp8":
        import torch
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        mx = MXTensor.to_mx(w, torch.float8_e4m3fn, fmt.block[1])
        return {"": mx.qdata, SCALE: mx.scale.reshape(w.shape[0], -1)}
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    global_scale = per_tensor_amax_to_scale(w.abs().max().float())
    nv = NVFP4Tensor.to_nvfp4(w, block_size=fmt.block[1], per_tensor_scale=global_scale)
    return {"": nv.qdata, SCALE: nv.scale.reshape(w.shape[0], -1), GLOBAL_SCALE: global_scale.reshape(1)}


def _pad_to_blocks(fmt: WeightFormat, t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) padded with zeros to whole blocks of a ragged format; ``t`` itself when it fits."""
    if not fmt.ragged:
        return t
    import torch
    import torch.nn.functional as F

    pad_rows, pad_cols = (-n % b if b else 0 for n, b in zip(t.shape, fmt.block, strict=True))
    if not (pad_rows or pad_cols):
        return t
    if t.element_size() == 1 and t.is_floating_point():  # float8: pad its bytes (0x00 is +0.0)
        return F.pad(t.view(torch.uint8), (0, pad_cols, 0, pad_rows)).view(t.dtype)
    return F.pad(t, (0, pad_cols, 0, pad_rows))


def _fp8_scale_shape(fmt: WeightFormat, shape: tuple[int, ...]) -> tuple[int, int]:
    if fmt.name == "fp8_tensor":
        return (1, 1)
    if fmt.name == "fp8_row":
        return (shape[0], 1)
    return (-(-shape[0] // fmt.block[0]), -(-shape[1] // fmt.block[1]))


def dequantize(fmt: WeightFormat, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The high-precision weight (``dtype``) that :func:`quantize`'s ``parts`` stand for (torchao's
    dequantization)."""
    require_torchao(f"weight format {fmt.name!r}")
    import torch

    qdata, scale = parts[""], parts[SCALE]
    if fmt.name.startswith("fp8_"):
        from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

        rows, cols = qdata.shape
        block = [rows if fmt.block[0] == 0 else fmt.block[0], cols if fmt.block[1] == 0 else fmt.block[1]]
        padded = _pad_to_blocks(fmt, qdata)
        dense = Float8Tensor(padded, scale.float(), block_size=block, dtype=dtype).dequantize(dtype)
        return dense[:rows, :cols].contiguous() if padded is not qdata else dense
    if fmt.name == "mxfp8":
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        mx = MXTensor(qdata, scale.reshape(-1), torch.float8_e4m3fn, fmt.block[1], dtype, None, None, False)
        return mx.dequantize(dtype)
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    nv = NVFP4Tensor(qdata, scale, fmt.block[1], dtype, per_tensor_scale=parts[GLOBAL_SCALE].float().reshape(()))
    return nv.dequantize(dtype)
