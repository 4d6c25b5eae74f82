"""miles-shm-transport: an example third-party weight transport for Miles (``shm``).

Importing this package is cheap; torch is imported by the transport's methods.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
