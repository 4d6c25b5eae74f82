"""The ``wandb`` metrics logger (Weights & Biases; ``pip install "miles-core[wandb]"``). ``mode = "offline"`` by
default: runs are written under the run directory and can be synced later with ``wandb sync``."""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from miles.components import ComponentSettings, Register, Requirement
from miles.markers import hookimpl
from miles.metrics.base import MetricsLogger

WANDB = Requirement("wandb", extra="wandb")


class WandbSettings(ComponentSettings):
    """Settings of the ``wandb`` logger."""

    project: str = "miles"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user)."""
    name: str | None = None
    """Run name (default: W&B's)."""
    mode: Literal["offline", "online", "disabled"] = "offline"
    """``offline`` writes locally (sync later with ``wandb sync``); ``online`` needs network access."""
    tags: list[str] = Field(default_factory=list)
    """Run tags."""


class WandbLogger(MetricsLogger[WandbSettings]):
    """Logs scalars to a W&B run stored in ``<run_dir>/wandb``."""

    name = "wandb"
    requires = (WANDB,)

    def __init__(self, settings: WandbSettings, *, run_dir: str) -> None:
        super().__init__(settings, run_dir=run_dir)
        wandb = WANDB.load("log.loggers: logger 'wandb'")
        os.makedirs(run_dir, exist_ok=True)
        self._run: Any = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name,
            mode=settings.mode,
            tags=list(settings.tags),
            dir=run_dir,
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.path: str = str(self._run.dir)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        if self._run is None:
            return
        # wandb leaves the pipes of its service process to the garbage collector; collect them here,
        # quietly, rather than let a ResourceWarning surface at some later, unrelated moment
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            self._run.finish()
            self._run = None
            gc.collect()


@hookimpl
def miles_register_loggers(register: Register) -> None:
    register(WandbLogger)
