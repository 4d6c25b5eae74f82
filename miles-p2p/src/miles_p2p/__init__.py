"""miles-p2p: the ``p2p`` weight transport of Miles (each trainer rank's slices straight to the engines).

Importing this package is cheap; torch (and Mooncake, for its data path) are imported where used.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
