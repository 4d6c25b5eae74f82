"""Deprecated: :class:`~miles.testing.engine.EngineProcess` lives in the test kit, :mod:`miles.testing.engine`.

This module re-exports it for one release (it goes in 0.2) and warns (``DeprecationWarning``) when imported;
import ``from miles.testing.engine import EngineProcess`` instead.
"""

from __future__ import annotations

import warnings

from miles.testing.engine import EngineProcess

__all__ = ["EngineProcess"]

warnings.warn(
    "miles.engine.process is deprecated: import EngineProcess from miles.testing.engine (the re-export goes in 0.2)",
    DeprecationWarning,
    stacklevel=2,
)
