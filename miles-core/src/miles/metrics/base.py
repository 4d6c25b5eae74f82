"""The metrics-logger interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

from miles.components import Component, SettingsT

__all__ = ["MetricsLogger"]


class MetricsLogger(Component[SettingsT], ABC):
    """Receives scalar metrics every step. Registered with ``miles_register_loggers``."""

    def __init__(self, settings: SettingsT, *, run_dir: str) -> None:
        super().__init__(settings)
        self.run_dir = run_dir

    @abstractmethod
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` for training step ``step``."""

    def close(self) -> None:
        """Flush and close."""
