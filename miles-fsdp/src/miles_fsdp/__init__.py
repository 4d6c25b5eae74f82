"""miles-fsdp: the ``fsdp`` trainer backend of Miles (PyTorch FSDP2 over Hugging Face causal LMs).

Importing this package is cheap; torch and transformers are imported by the modules that use them.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
