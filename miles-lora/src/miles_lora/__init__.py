"""miles-lora: LoRA RL on PEFT for Miles — adapter-only training, weight sync and export."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
