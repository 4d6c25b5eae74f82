"""Built-in precision recipes: ``fp32`` and ``bf16`` (bf16 compute, fp32 gradient reduction)."""

from __future__ import annotations

from miles.components import Register
from miles.markers import hookimpl
from miles.precision.base import PrecisionRecipe


class FP32(PrecisionRecipe):
    """Everything in float32; weights reach the engines in float32."""

    name = "fp32"


class BF16(PrecisionRecipe):
    """bfloat16 parameters and compute, float32 gradient reduction; weights sent as bfloat16."""

    name = "bf16"
    param_dtype = "bfloat16"


@hookimpl
def miles_register_precisions(register: Register) -> None:
    register(FP32)
    register(BF16)
