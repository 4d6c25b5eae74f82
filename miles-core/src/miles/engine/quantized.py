"""The local engine's quantized projections (``--quantization fp8_block | fp8_row | fp8_tensor | mxfp8 | nvfp4``).

At load, every ``nn.Linear`` whose weight the precision recipes quantize (:func:`miles.precision.quantized.
quantizes`, the trainer's rule) becomes a :class:`QuantizedLinear` holding exactly what a push carries —
``weight`` (quantized values), ``weight_scale`` and, for NVFP4, ``weight_scale_2`` — as parameters under
those HF names, so every transport loads into them, ``/weights_checksum`` hashes the quantized bytes the
engine computes with, and a delta push XORs them in place.

How it computes (logged once per engine):

- ``fp8_row`` / ``fp8_tensor``: ``torch._scaled_mm`` on FP8 operands (CPU and CUDA), activations
  quantized to e4m3 on the fly with the weight's granularity (per token / per tensor): W8A8.
- ``fp8_block``, ``mxfp8``, ``nvfp4``: the weight is dequantized with torchao (once per weight update,
  cached) and multiplied in the engine dtype: weight-only emulation of the format, on every device. On a
  CPU where the engine prepacks its bf16 / fp32 weights for oneDNN (:mod:`miles.engine.model_runner`), the
  dequantized weight is cached prepacked too, and the runner multiplies q/k/v and gate/up as one matrix
  each, as it does unquantized weights: the emulated formats decode at about the engine dtype's speed (bit
  for bit the results of ``F.linear`` one projection at a time).

A format the engine cannot run is refused at startup with a message naming it: torchao missing, FP8
``_scaled_mm`` unavailable for ``fp8_row`` / ``fp8_tensor`` on the device, or a model in which no weight
fits the format's blocks.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from miles.precision.formats import FP8_MAX, GLOBAL_SCALE, SCALE, WeightFormat, dequantize, get_format, require_torchao
from miles.precision.quantized import quantizes

__all__ = ["QuantizedLinear", "quantize_model"]

log = logging.getLogger(__name__)

SCALED_MM_FORMATS = ("fp8_row", "fp8_tensor")


@functools.cache
def _scaled_mm_works(device_type: str, rowwise: bool) -> str | None:
    """``None`` when FP8 ``torch._scaled_mm`` runs on ``device_type`` with these scales, else why not."""
    try:
        a = torch.ones(16, 32, device=device_type).to(torch.float8_e4m3fn)
        b = torch.ones(16, 32, device=device_type).to(torch.float8_e4m3fn)
        sa = torch.ones((16, 1) if rowwise else (), device=device_type)
        sb = torch.ones((1, 16) if rowwise else (), device=device_type)
        out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        if not torch.all(out == 32):
            return "it computed a wrong result on a probe"
        return None
    except (RuntimeError, NotImplementedError) as exc:
        return str(exc).splitlines()[0]


def _quantize_activation(x: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D) as e4m3 values and fp32 dequantization scales (per row, or one for the tensor)."""
    amax = x.abs().amax(dim=1, keepdim=True) if rowwise else x.abs().amax()
    scale = (amax.float() / FP8_MAX).clamp(min=1e-12)
    values = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale


class QuantizedLinear(torch.nn.Module):
    """``nn.Linear`` over a quantized weight (its parts are parameters, named as the push names them)."""

    def __init__(self, fmt: WeightFormat, linear: torch.nn.Linear, *, use_scaled_mm: bool, pack: int = 0) -> None:
        super().__init__()
        from miles.precision.formats import quantize

        self.fmt = fmt
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        self.use_scaled_mm = use_scaled_mm
        self.pack = 0 if use_scaled_mm else pack
        """Rows (a decode batch) oneDNN's prepacked layout of the dequantized weight is tuned for, which is
        then cached prepacked instead of dense (CPU); ``0``: not prepacked."""
        parts = quantize(fmt, linear.weight.detach())
        self.weight = torch.nn.Parameter(parts[""], requires_grad=False)
        self.weight_scale = torch.nn.Parameter(parts[SCALE], requires_grad=False)
        if GLOBAL_SCALE in parts:
            self.weight_scale_2 = torch.nn.Parameter(parts[GLOBAL_SCALE], requires_grad=False)
        self.bias = linear.bias
        self._dense: tuple[tuple[int, ...], torch.Tensor] | None = None
        self._packed: tuple[tuple[int, ...], torch.Tensor] | None = None

    def parts(self) -> dict[str, torch.Tensor]:
        """The quantized parts, by suffix (``""`` values, ``"_scale"``, NVFP4's ``"_scale_2"``)."""
        parts = {"": self.weight, SCALE: self.weight_scale}
        if hasattr(self, "weight_scale_2"):
            parts[GLOBAL_SCALE] = self.weight_scale_2
        return parts

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.parts().values())

    def _dequantized(self) -> torch.Tensor:
        return dequantize(self.fmt, {k: v.detach() for k, v in self.parts().items()}, self.compute_dtype)

    def dense_weight(self) -> torch.Tensor:
        """The dequantized weight in the compute dtype (cached when not prepacked; rebuilt after any of
        the parts changed)."""
        if self.pack:
            return self._dequantized()
        versions = self._versions()
        if self._dense is None or self._dense[0] != versions:
            self._dense = (versions, self._dequantized())
        return self._dense[1]

    def _packed_weight(self) -> torch.Tensor:
        versions = self._versions()
        if self._packed is None or self._packed[0] != versions:
            self._packed = (versions, torch.ops.mkldnn._reorder_linear_weight(self._dequantized(), self.pack))
        return self._packed[1]

    def drop_cache(self) -> None:
        """Free the dequantized (or prepacked) weight; the next forward rebuilds it."""
        self._dense = self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pack:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), self.bias, "none", [], "")
        if not self.use_scaled_mm:
            return F.linear(x, self.dense_weight(), self.bias)
        rowwise = self.fmt.name == "fp8_row"
        flat = x.reshape(-1, self.in_features)
        values, scale_a = _quantize_activation(flat, rowwise)
        scale_b = self.weight_scale.reshape(1, -1) if rowwise else self.weight_scale.reshape(())
        out = torch._scaled_mm(
            values, self.weight.t(), scale_a=scale_a, scale_b=scale_b.float(), bias=None, out_dtype=x.dtype
        )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        how = "_scaled_mm" if self.use_scaled_mm else "dequantize+matmul" + (" (prepacked)" if self.pack else "")
        return f"{self.in_features} -> {self.out_features}, {self.fmt.name}, {how}"


def quantize_model(model: torch.nn.Module, format_name: str, *, pack: int = 0) -> int:
    """Replace the model's quantizable ``nn.Linear`` modules by :class:`QuantizedLinear` (their current
    weights quantized; ``pack``: dequantized weights cached prepacked for oneDNN for that many rows, CPU
    only, ``0`` not); returns how many. Refuses (``ValueError``) what the engine cannot run."""
    where = f"quantization {format_name!r}"
    fmt = get_format(format_name)
    try:
        require_torchao(where)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    device = next(model.parameters()).device
    use_scaled_mm = fmt.name in SCALED_MM_FORMATS
    if use_scaled_mm:
        problem = _scaled_mm_works(device.type, fmt.name == "fp8_row")
        if problem is not None:
            raise ValueError(f"{where}: FP8 torch._scaled_mm does not run on {device} here ({problem})")
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and quantizes(fmt, f"{name}.weight", tuple(module.weight.shape))
    ]
    if not targets:
        raise ValueError(f"{where}: no projection weight of the model splits into {fmt.block} blocks")
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent: Any = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantizedLinear(fmt, module, use_scaled_mm=use_scaled_mm, pack=pack))
    how = (
        "torch._scaled_mm (FP8 W8A8)"
        if use_scaled_mm
        else "dequantize-then-matmul (weight-only emulation, dequantized once per weight update"
        + (", prepacked for oneDNN)" if pack else ")")
    )
    log.info(
        "%s: %d projections hold %s weights; they compute by %s on %s",
        where,
        len(targets),
        fmt.description,
        how,
        device,
    )
    return len(targets)
