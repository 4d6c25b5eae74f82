"""Deprecated: :class:`~miles.testing.engine.EngineProcess` lives in the test kit, :mod:`miles.testing.engine`.

This module re-exports it for one release (it goes in 0.2); import ``from miles.testing.engine import
EngineProcess`` instead.
"""

from __future__ import annotations

from miles.testing.engine import EngineProcess

__all__ = ["EngineProcess"]
