"""Moved to :mod:`miles.compose` (the composition root); this name goes in the next release."""

from __future__ import annotations

from miles.compat import moved_module

__getattr__ = moved_module(__name__, "miles.compose", distribution="miles-core")
