"""Settings of the ``lora`` adapter (``[train.adapter] name = "lora"`` and these keys)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles.components import ComponentSettings

__all__ = ["DEFAULT_TARGET_MODULES", "LoraSettings"]

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(ComponentSettings):
    """LoRA adapters (PEFT ``LoraConfig``) on the policy's linear layers."""

    r: int = Field(8, ge=1)
    """Rank of each adapter's ``A`` / ``B`` matrices."""
    alpha: int = Field(16, ge=1)
    """Scale numerator: the adapter's update is multiplied by ``alpha / r``."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input in training forwards (logprob passes run without it)."""
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    """Names of the linear layers that get adapters (the local engine serves ``q_proj k_proj v_proj o_proj
    gate_proj up_proj down_proj``)."""
    init: Literal["default", "gaussian", "random"] = "default"
    """Initial adapter weights: ``default`` (Kaiming ``A``, zero ``B``: training starts at the base model),
    ``gaussian`` (Gaussian ``A``, zero ``B``), ``random`` (both random: the adapter changes the model from
    the first step; for tests)."""
    lora_name: str = "policy"
    """The name the engines serve the adapter under (SGLang's ``lora_name``; requests pick it with
    ``lora_path``)."""
