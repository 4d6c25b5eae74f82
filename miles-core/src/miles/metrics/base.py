"""The metrics-logger interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from pydantic import BaseModel

from miles.components import ComponentSettings

__all__ = ["MetricsLogger"]


class MetricsLogger(ABC):
    """Receives scalar metrics every step. Registered with ``miles_register_loggers``."""

    name: ClassVar[str]
    Settings: ClassVar[type[BaseModel]] = ComponentSettings

    def __init__(self, settings: BaseModel, *, run_dir: str) -> None:
        self.settings = settings
        self.run_dir = run_dir

    @abstractmethod
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` for training step ``step``."""

    def close(self) -> None:
        """Flush and close."""
