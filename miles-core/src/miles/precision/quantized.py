"""Low-precision rollout recipes: ``fp8``, ``mxfp8`` and ``nvfp4``.

The trainer computes in bfloat16 over float32 master weights (the ``bf16`` recipe's contract); on the way
out of the trainer (:meth:`rollout_weights`) every projection weight is quantized with torchao
(:mod:`miles.precision.formats`) and pushed as its quantized values under the weight's own name plus
its scales (``<module>.weight_scale``, NVFP4 also ``<module>.weight_scale_2``). The engines are launched
with ``quantization = <format>`` (:attr:`engine_quantization`), hold exactly those tensors and compute
with them (:mod:`miles.engine.quantized`); weight verification checks the quantized bytes and scales.

What stays high precision (bfloat16), in every recipe: embeddings, ``lm_head``, norms, biases, the MoE
router (``mlp.gate``, ``shared_expert_gate``), every tensor that is not a 2-D ``.weight`` and every
weight whose shape does not split into the format's scale blocks (:func:`quantizes` is the one rule the
trainer and the engine share).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from miles.components import ComponentSettings, Register, SettingsT
from miles.markers import hookimpl
from miles.precision.base import PrecisionRecipe
from miles.precision.formats import TORCHAO, WeightFormat, get_format, quantize, quantizes

if TYPE_CHECKING:
    import torch

    from miles.precision.base import SliceT

__all__ = ["FP8", "MXFP8", "NVFP4", "QuantizedRecipe", "quantizes"]

log = logging.getLogger(__name__)


class QuantizedRecipe(PrecisionRecipe[SettingsT], ABC):
    """bf16 training (fp32 master weights, fp32 reduction); projection weights sent and served quantized."""

    param_dtype = "bfloat16"
    reduce_dtype = "float32"
    requires = (TORCHAO,)

    @property
    @abstractmethod
    def weight_format(self) -> WeightFormat:
        """The format projection weights travel and are served in (each recipe says which)."""

    @property
    def engine_quantization(self) -> str | None:
        return self.weight_format.name

    def rollout_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        fmt = self.weight_format
        for name, tensor in named:
            if not quantizes(fmt, name, tuple(tensor.shape)):
                yield name, tensor
                continue
            for suffix, part in quantize(fmt, tensor).items():
                yield name + suffix, part

    def rollout_shards(self, shards: Sequence[SliceT], gather: Callable[[Any], list[Any]]) -> list[SliceT]:
        """The quantized values and scales from each rank's rows (:mod:`miles.precision.shards`)."""
        from miles.precision.shards import quantize_shards

        return quantize_shards(self.weight_format, shards, gather)


class FP8Settings(ComponentSettings):
    """Settings of the ``fp8`` recipe."""

    granularity: Literal["block", "row", "tensor"] = Field("block")
    """Scale granularity: ``block`` (one fp32 scale per 128x128 block, DeepSeek-V3 style; the engine
    dequantizes then multiplies), ``row`` (one per output row) or ``tensor`` (one per weight); ``row`` and
    ``tensor`` run ``torch._scaled_mm`` with activations quantized the same way on the fly (W8A8)."""


class FP8(QuantizedRecipe[FP8Settings]):
    """FP8 e4m3 rollout weights with fp32 scales (block / row / tensor), bf16 training."""

    name = "fp8"

    @property
    def weight_format(self) -> WeightFormat:
        return get_format(f"fp8_{self.settings.granularity}")


class MXFP8(QuantizedRecipe[ComponentSettings]):
    """MXFP8 (OCP MX) rollout weights: e4m3 values, one e8m0 scale per block of 32; bf16 training."""

    name = "mxfp8"

    @property
    def weight_format(self) -> WeightFormat:
        return get_format("mxfp8")


class NVFP4(QuantizedRecipe[ComponentSettings]):
    """NVFP4 rollout weights: e2m1 values (two per byte), e4m3 scales per block of 16 and an fp32 scale per
    tensor; bf16 training."""

    name = "nvfp4"

    @property
    def weight_format(self) -> WeightFormat:
        return get_format("nvfp4")


@hookimpl
def miles_register_precisions(register: Register) -> None:
    register(FP8)
    register(MXFP8)
    register(NVFP4)
