"""The model-adapter interface: parameter-efficient fine-tuning of the policy (LoRA ...).

A trainer backend that supports adapters (``fsdp``) asks the adapter selected by ``train.adapter`` to wrap
the freshly loaded policy before sharding it, trains only the parameters the adapter leaves trainable,
uses the base model (the adapter switched off) as the KL reference, and yields only the adapter's
tensors as its weights for the engines. miles-lora registers ``lora`` (on PEFT).

A trainer whose model is not a Hugging Face module (``megatron``: fused, tensor-parallel projections)
cannot take :meth:`ModelAdapter.apply`; it builds the adapter's layers itself from
:meth:`ModelAdapter.low_rank`, and gives the engines the same tensors under the same names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from miles.components import Component, SettingsT

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["LowRankSpec", "ModelAdapter"]


@dataclass(frozen=True)
class LowRankSpec:
    """A LoRA adapter as a trainer that builds its own adapter layers reads it.

    Each targeted projection ``W`` (``[out, in]``) computes ``W x + scaling * B A dropout(x)`` with ``A``
    ``[r, in]`` and ``B`` ``[out, r]``. The tensors travel, and are saved, in PEFT's file naming
    (:meth:`tensor_name`), which SGLang and the local engine load.
    """

    r: int
    """Rank of ``A`` / ``B``."""
    alpha: float
    """``scaling = alpha / r``."""
    dropout: float
    """Dropout on the adapter's input in training forwards."""
    target_modules: tuple[str, ...]
    """Hugging Face projection names that get adapters (``q_proj`` ... ``down_proj``)."""
    init: Literal["default", "gaussian", "random"] = "default"
    """``default``: ``A`` uniform in ``±1/sqrt(in)`` (PEFT's Kaiming), ``B`` zero; ``gaussian``: ``A``
    normal with std ``1/r``, ``B`` zero; ``random``: both uniform (``B`` in ``±1/sqrt(r)``)."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    @staticmethod
    def tensor_name(module: str, part: Literal["lora_A", "lora_B"]) -> str:
        """The file name of ``module``'s (a HF name: ``model.layers.0.self_attn.q_proj``) ``A`` or ``B``."""
        return f"base_model.model.{module}.{part}.weight"

    def merge(self, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``weight + scaling * b @ a``, computed in float32, in ``weight``'s dtype."""
        return (weight.float() + (b.float() @ a.float()) * self.scaling).to(weight.dtype)


class ModelAdapter(Component[SettingsT], ABC):
    """Wraps the policy model with trainable adapters. Registered with ``miles_register_adapters``."""

    @abstractmethod
    def apply(self, model: nn.Module) -> nn.Module:
        """The model with adapters added (base parameters frozen); the trainer shards and trains it."""

    @abstractmethod
    def disabled(self, model: nn.Module) -> AbstractContextManager[Any]:
        """A context in which ``model`` (as :meth:`apply` returned it) computes the base model: the KL
        reference without a second copy of the weights."""

    @abstractmethod
    def adapter_name(self, name: str) -> str | None:
        """The engine-side name of a parameter of the wrapped model if it belongs to the adapter (the
        weights a push carries), else ``None``."""

    @abstractmethod
    def adapter_config(self) -> dict[str, Any]:
        """The adapter's configuration as the engines and exports read it (``adapter_config.json``)."""

    def low_rank(self) -> LowRankSpec | None:
        """The adapter as a :class:`LowRankSpec`, for trainers that build its layers themselves; ``None``
        (the default) when it is not a LoRA adapter."""
        return None

    @abstractmethod
    def merged(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The base model's weights in Hugging Face naming with the adapters merged in, from the wrapped
        model's ``(parameter name, full tensor)`` pairs in parameter order (a stream)."""
