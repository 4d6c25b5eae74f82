"""The launcher interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import BaseModel

from miles.components import ComponentSettings
from miles.rollout.engine import EngineLaunch

__all__ = ["Launcher", "ProcessSpec"]


@dataclass
class ProcessSpec:
    """One process to start."""

    name: str
    """Shown in logs and errors (``trainer-0``, ``engine-1``)."""
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None


class Launcher(ABC):
    """Starts processes on some set of machines. Registered with ``miles_register_launchers``.

    A launcher owns every process it starts: :meth:`shutdown` terminates and reaps them all (never by
    name), and it is called on normal exit, on Ctrl-C and on failure.
    """

    name: ClassVar[str]
    Settings: ClassVar[type[BaseModel]] = ComponentSettings

    def __init__(self, settings: BaseModel) -> None:
        self.settings = settings

    @abstractmethod
    def start_engines(self, launches: list[EngineLaunch], *, timeout: float) -> list[str]:
        """Start engine servers, wait until each answers its health path; return their base URLs."""

    @abstractmethod
    def start_trainers(self, specs: list[ProcessSpec]) -> None:
        """Start the trainer ranks (``specs[i]`` is rank ``i``; rendezvous variables already in ``env``)."""

    @abstractmethod
    def wait_trainers(self) -> int:
        """Block until every trainer rank exits; return the first non-zero exit code, else 0."""

    @abstractmethod
    def shutdown(self) -> None:
        """Terminate and reap everything started (idempotent)."""
