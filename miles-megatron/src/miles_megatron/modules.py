"""Small helpers on Megatron modules, shared by the model, weights and checkpoint code."""

from __future__ import annotations

from typing import Any

__all__ = ["unwrap"]


def unwrap(model: Any) -> Any:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model
