"""The ``tensorboard`` metrics logger (needs the ``tensorboard`` package: ``pip install "miles-core[tensorboard]"``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from miles.components import ComponentSettings, Register, Requirement
from miles.markers import hookimpl
from miles.metrics.base import MetricsLogger

TENSORBOARD = Requirement("tensorboard", extra="tensorboard")


class TensorBoardSettings(ComponentSettings):
    """Settings of the ``tensorboard`` logger."""

    subdir: str = "tensorboard"
    """Event-file directory inside the run directory."""
    flush_secs: int = 10
    """How often events are flushed to disk."""


class TensorBoardLogger(MetricsLogger[TensorBoardSettings]):
    """Writes scalars as TensorBoard event files (``tensorboard --logdir RUN_DIR/tensorboard``)."""

    name = "tensorboard"
    requires = (TENSORBOARD,)

    def __init__(self, settings: TensorBoardSettings, *, run_dir: str) -> None:
        super().__init__(settings, run_dir=run_dir)
        summary = TENSORBOARD.load("log.loggers: logger 'tensorboard'", "torch.utils.tensorboard")
        self.log_dir = os.path.join(run_dir, settings.subdir)
        self._writer: Any = summary.SummaryWriter(log_dir=self.log_dir, flush_secs=settings.flush_secs)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._writer.add_scalar(key, float(value), global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


@hookimpl
def miles_register_loggers(register: Register) -> None:
    register(TensorBoardLogger)
