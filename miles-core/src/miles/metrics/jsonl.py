"""The built-in ``jsonl`` metrics logger: one JSON object per step in ``<run_dir>/metrics.jsonl``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import IO

from miles.components import ComponentSettings, Register
from miles.markers import hookimpl
from miles.metrics.base import MetricsLogger


class JsonlLoggerSettings(ComponentSettings):
    """Settings of the ``jsonl`` logger."""

    filename: str = "metrics.jsonl"
    """File name inside the run directory."""


class JsonlLogger(MetricsLogger[JsonlLoggerSettings]):
    """Appends ``{"step": N, ...metrics}`` lines to a file in the run directory."""

    name = "jsonl"

    def __init__(self, settings: JsonlLoggerSettings, *, run_dir: str) -> None:
        super().__init__(settings, run_dir=run_dir)
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, settings.filename)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._file is None:
            raise RuntimeError(f"jsonl logger for {self.path} is closed")
        row: dict[str, float | int | None] = {"step": step}
        row.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@hookimpl
def miles_register_loggers(register: Register) -> None:
    register(JsonlLogger)
