"""The weight-transport interface.

After a training step every trainer rank calls :meth:`WeightTransport.push` with the trainer's bucket
iterator (gathering is a collective); the transport decides which rank sends what. Afterwards the core
verifies that the engines serve the new version and the expected checksums.

A :class:`StagedTransport` splits a push in two: :meth:`~StagedTransport.stage`, on every rank, takes what
it needs from the trainer's weights (they change at the next step), and :meth:`~StagedTransport.commit`,
on rank 0, makes the engines load it. Async training overlaps the commit with the next training step.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from miles.components import Component, SettingsT
from miles.types import PushReport

if TYPE_CHECKING:
    import torch

    from miles.rollout.backend import EngineCapabilities
    from miles.rollout.client import EngineClient
    from miles.training.trainer import DistContext, Trainer, WeightBucket

__all__ = ["PushReport", "StagedTransport", "WeightTransport", "weight_dirs", "wire_dtype"]


def wire_dtype(name: str, tensor: torch.Tensor, engine_dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor travels in: weights in the engine dtype; quantized values (float8, e8m0, packed
    integers) and their scales (``*.weight_scale``, ``*.weight_scale_2``) as the precision recipe made
    them (:mod:`miles.precision.formats`)."""
    from miles.precision.formats import keeps_dtype

    return tensor.dtype if keeps_dtype(name, tensor) else engine_dtype


class WeightTransport(Component[SettingsT], ABC):
    """A way to deliver weights. Registered with ``miles_register_transports``."""

    engine_capabilities: EngineCapabilities | None = None
    """What the run's engines support (their kind's capabilities), set by the composition root."""

    engine_routes: ClassVar[tuple[str, ...]] = ()
    """Routes beyond SGLang's protocol this transport needs on every engine (Miles' own engine serves them:
    :attr:`~miles.rollout.backend.EngineCapabilities.miles_weight_routes`). A run whose engine lacks them is
    refused at start, naming both fields.

    .. versionadded:: 0.1
    """

    engine_needs: ClassVar[tuple[str, ...]] = ()
    """:class:`~miles.rollout.backend.EngineCapabilities` this transport needs of the run's engines (their
    field names, e.g. ``update_weights_from_tensor``). A run whose engine lacks one is refused at start,
    naming both fields.

    .. versionadded:: 0.1
    """

    reads_buckets: ClassVar[bool] = True
    """Whether :meth:`push` iterates the buckets it is given (gathering them is a collective of every rank).
    ``False`` for a transport that sends the trainer's own slices (:meth:`attach`): after a failed push the
    buckets are then not drained.

    .. versionadded:: 0.1
    """

    def __init__(self, settings: SettingsT, *, run_dir: str, model_path: str | None, engine_dtype: str) -> None:
        """
        :param run_dir: the run's output directory (scratch space for disk-based transports).
        :param model_path: the initial model directory (its config and tokenizer files).
        :param engine_dtype: dtype the engines serve (``float32`` / ``bfloat16``); checksums use it.
        """
        super().__init__(settings)
        self.run_dir = run_dir
        self.model_path = model_path
        self.engine_dtype = engine_dtype

    @classmethod
    def shared_dirs(cls, options: SettingsT, *, run_dir: str) -> dict[str, str]:
        """Directories trainer rank 0 writes and the engines read, each under the settings field that names it
        (``{"transport.dir": "/shared/run/weights"}``). A launcher that places processes on several nodes
        checks, before anything starts, that every engine's node sees them
        (:meth:`~miles.launch.base.Launcher.unshared`); a run whose engines would not is refused, naming the
        field. Default: none (the transport moves weights over the network).

        .. versionadded:: 0.1
        """
        return {}

    def attach(self, trainer: Trainer) -> None:
        """Called once on every rank, before :meth:`connect`, with this rank's trainer. A transport that
        reads the trainer's own slices (:meth:`~miles.training.trainer.Trainer.iter_weight_shards`, as
        ``p2p`` does) keeps it; the buckets :meth:`push` receives are then never iterated, so nothing is
        gathered. The default keeps nothing.

        .. versionadded:: 0.1
        """

    async def connect(self, client: EngineClient | None, dist: DistContext) -> None:
        """Set up channels (process groups, directories) once, before the first push.

        :param client: the engines (``None`` on ranks that do not talk to engines).
        """

    @abstractmethod
    async def push(self, buckets: Iterable[WeightBucket], *, version: str, dist: DistContext) -> PushReport:
        """Deliver every bucket and make the engines report ``version``. Every rank calls it."""

    async def verify(self, client: EngineClient, report: PushReport) -> dict[str, float] | None:
        """Rank 0, after a push when ``transport.verify`` is on: check what the engines serve in this
        transport's own way and return the metrics, or ``None`` for the driver's check of the full weights
        (``/weights_checksum``). A mismatch raises :class:`~miles.errors.WeightVerificationError`.

        .. versionadded:: 0.1
        """
        return None

    async def close(self) -> None:
        """Tear channels down."""


class StagedTransport(WeightTransport[SettingsT]):
    """A transport whose push splits into a trainer side (:meth:`stage`) and an engine side
    (:meth:`prepare`, :meth:`commit`) that may run later, while the trainer trains on."""

    async def push(self, buckets: Iterable[WeightBucket], *, version: str, dist: DistContext) -> PushReport:
        """The three parts in a row (the in-line push: no snapshot, the trainer waits for the commit)."""
        report = await self.stage(buckets, version=version, dist=dist, snapshot=False)
        if dist.rank == 0:
            await self.prepare(report)
            await self.commit(report)
        return report

    @abstractmethod
    async def stage(
        self, buckets: Iterable[WeightBucket], *, version: str, dist: DistContext, snapshot: bool = True
    ) -> PushReport:
        """Consume the buckets; the engines still serve the previous version. Every rank calls it.

        :param snapshot: copy what the buckets hold, so that the trainer may change its weights before
            :meth:`commit` (``False`` only when the commit follows before the trainer moves on)."""

    async def prepare(self, report: PushReport) -> None:
        """Between :meth:`stage` and :meth:`commit` (rank 0), while the engines still generate: work that
        needs no pause (writing files)."""

    @abstractmethod
    async def commit(self, report: PushReport) -> None:
        """Make the engines load what :meth:`stage` staged and report its version (rank 0);
        ``report.checksums`` is complete when it returns."""


def weight_dirs(run_dir: str, options: object) -> list[str]:
    """The directories a run's engines may load weights from (:mod:`miles.engine.weight_paths`): the run
    directory and the transport's ``dir`` setting, for transports that have one (``disk``, ``disk_delta``,
    a third party's ``/dev/shm`` transport ...)."""
    dirs = [os.path.abspath(run_dir)]
    extra = getattr(options, "dir", None)
    if isinstance(extra, str) and extra:
        dirs.append(os.path.abspath(extra))
    return dirs
