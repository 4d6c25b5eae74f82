"""The reward interface: an async function of a sample that returns a number (or named parts), and the server
a reward may need the run to start for it (a reward model)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.components import Component, SettingsT

if TYPE_CHECKING:
    from miles.types import Sample

__all__ = ["Reward", "RewardOutput", "RewardServer"]


@dataclass
class RewardOutput:
    """A reward with named parts (``value`` is what trains; parts are logged)."""

    value: float
    parts: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardServer:
    """A server a reward needs for the run (a reward model, a judge).

    ``miles train`` (and ``miles generate`` / ``miles eval``) starts it through the launcher as a process of its
    own before the trainer ranks, waits until it answers :attr:`health_path`, and sets the reward's ``url``
    setting to it in the run's resolved settings: the reward's settings model must have a ``url`` field, and a
    reward whose ``url`` is set uses that server instead (:meth:`Reward.server` then answers ``None``).
    """

    model_path: str
    """The model it serves."""
    engine: dict[str, Any] | None = None
    """Served by a rollout engine (``{"name": "local", ...its settings}``), started like a policy engine but
    never sent weights; ``None``: by :attr:`module`."""
    module: str | None = None
    """Else ``python -m <module> --model M --host H --port P --device D --dtype T`` followed by :attr:`args`."""
    args: tuple[str, ...] = ()
    device: str = "auto"
    """``auto`` (``cluster.device``), ``cpu`` or ``cuda``."""
    colocate: bool = False
    """On CUDA: share the first GPU of the run (with trainer rank 0) instead of a GPU of its own."""
    dtype: str = "auto"
    startup_timeout: float = 300.0
    """Seconds it may take to answer :attr:`health_path`."""
    restarts: int = 1
    """Times it is started again when it exits while the run goes on."""
    health_path: str = "/health"


class Reward(Component[SettingsT], ABC):
    """A reward function. Registered with ``miles_register_rewards``.

    ``score`` may be slow (a remote model, a sandbox); the rollout manager runs it with the timeout of
    the ``reward`` settings, and an exception or a timeout marks the sample failed with the reason.
    """

    @abstractmethod
    async def score(self, sample: Sample) -> float | RewardOutput:
        """Score one completed sample (``sample.response``, ``sample.label``, ``sample.metadata``)."""

    def server(self) -> RewardServer | None:
        """The server the run must start for this reward (see :class:`RewardServer`), or ``None`` (default)."""
        return None

    async def close(self) -> None:
        """Release connections (HTTP clients ...)."""
