"""miles-megatron: the ``megatron`` trainer backend of Miles (Megatron-Core: tensor, pipeline, data and
expert parallelism) and Hugging Face <-> Megatron weight conversion.

Importing this package is cheap; torch, megatron and mbridge are imported by the modules that use them.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
