"""The model-adapter interface: parameter-efficient fine-tuning of the policy (LoRA ...).

A trainer backend that supports adapters (``fsdp``) asks the adapter selected by ``train.adapter`` to wrap
the freshly loaded policy before sharding it, trains only the parameters the adapter leaves trainable,
uses the base model (the adapter switched off) as the KL reference, and yields only the adapter's
tensors as its weights for the engines. miles-lora registers ``lora`` (on PEFT).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from miles.components import Component, SettingsT

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["ModelAdapter"]


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

    @abstractmethod
    def merged(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The base model's weights in Hugging Face naming with the adapters merged in, from the wrapped
        model's ``(parameter name, full tensor)`` pairs in parameter order (a stream)."""
