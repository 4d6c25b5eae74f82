"""Moved to :mod:`miles_fsdp.packed_attention` (the FSDP trainer is its only user); this name goes in the next release."""

from __future__ import annotations

from miles.compat import moved_module

__getattr__ = moved_module(__name__, "miles_fsdp.packed_attention", distribution="miles-fsdp")
