"""The precision-recipe interface."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

from miles.components import Component, SettingsT

if TYPE_CHECKING:
    import torch

__all__ = ["PrecisionRecipe"]


class PrecisionRecipe(Component[SettingsT]):
    """Training dtypes plus an optional conversion of rollout weights (e.g. FP8 with block scales).

    Registered with ``miles_register_precisions``. The base class is the identity recipe in fp32.
    """

    param_dtype: ClassVar[str] = "float32"
    """Dtype the trainer computes in (``float32`` / ``bfloat16``)."""
    reduce_dtype: ClassVar[str] = "float32"
    """Dtype of gradient reduction across ranks."""

    @property
    def engine_quantization(self) -> str | None:
        """The weight format the engines must be launched with to load converted weights
        (``rollout.engine.quantization``; ``None``: the same dtype as sent)."""
        return None

    def rollout_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Convert HF-named trainer weights to what the engines load (may add scale tensors)."""
        yield from named
