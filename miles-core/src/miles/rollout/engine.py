"""Moved to :mod:`miles.rollout.backend` (the rollout-engine backends' interface: ``RolloutEngine``,
``EngineLaunch``, ``EngineCapabilities``); this name goes in the next release."""

from __future__ import annotations

from miles.compat import moved_module

__getattr__ = moved_module(__name__, "miles.rollout.backend", distribution="miles-core")
