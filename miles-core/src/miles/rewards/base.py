"""The reward interface: an async function of a sample that returns a number (or named parts) — or of a whole
group of samples (:class:`GroupReward`) — and the server a reward may need the run to start for it (a reward
model)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.components import Component, SettingsT

if TYPE_CHECKING:
    from miles.types import Sample

__all__ = ["GroupReward", "Reward", "RewardOutput", "RewardServer"]


@dataclass
class RewardOutput:
    """A reward with named parts (``value`` is what trains; parts are logged)."""

    value: float
    parts: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardServer:
    """A server a reward needs for the run (a reward model, a judge).

    ``miles train`` (and ``miles generate`` / ``miles eval``) starts it through the launcher as a process of its
    own before the trainer ranks (the ``ray`` launcher: in a placement group of its own, :attr:`cpus`,
    :attr:`memory`, :attr:`resources` and a GPU on CUDA, on a node Ray picks), waits until it answers
    :attr:`health_path`, and sets the reward's ``url`` setting to it in the run's resolved settings: the
    reward's settings model must have a ``url`` field, and a reward whose ``url`` is set uses that server
    instead (:meth:`Reward.server` then answers ``None``).
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
    """On CUDA: share the first GPU of the run (with trainer rank 0) instead of a GPU of its own (the ``local``
    launcher only)."""
    cpus: float = 1.0
    """CPUs a launcher that reserves resources (``ray``) reserves for it."""
    memory: int | None = None
    """Bytes of memory such a launcher reserves for it; ``None``: none reserved."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom resources its node must offer, with such a launcher (Ray: ``{"reward_node": 1}``)."""
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


class GroupReward(Reward[SettingsT], ABC):
    """A reward that scores the samples of one group (one prompt's rollouts) together: a value that depends on
    the other rollouts of the group (a rank within the group, "1 for the shortest correct answer", a verifiers
    rubric's group functions). Registered with ``miles_register_rewards`` like any reward.

    The rollout manager scores a group when all its samples are generated: :meth:`score_group` gets the samples
    of the group that reached scoring (failed, aborted and pending ones stay as they are, with their reason),
    once per group, bounded by the ``reward`` timeout; an exception or a timeout fails those samples with the
    reason. The sample's reward is the weighted sum of every function's value, as for a per-sample reward.

    .. versionadded:: 0.1
    """

    @abstractmethod
    async def score_group(self, samples: Sequence[Sample]) -> Sequence[float | RewardOutput | Exception]:
        """Score ``samples`` (one group, in group order) together: one result per sample, in the same order.
        An exception in place of a result fails that sample alone, with it as the reason."""

    async def score(self, sample: Sample) -> float | RewardOutput:
        """``sample`` as a group of one."""
        results = await self.score_group([sample])
        if len(results) != 1:
            raise ValueError(f"score_group returned {len(results)} results for a group of 1 sample")
        if isinstance(results[0], Exception):
            raise results[0]
        return results[0]
