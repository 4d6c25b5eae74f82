"""How the trainer's weights reach the engines after each step: the training loop's second seam.

- :class:`InlinePublisher`: every rank pushes through the transport, rank 0 verifies, and the step goes
  on when the engines serve the new version. While the group source produces (async modes) the engines
  are paused around the push (``rollout.pause_mode``). When engines die during the push and others are
  left, the whole version is pushed again to those (every rank takes part: the buckets are collectives).
- :class:`OverlappedPublisher`: async modes with a :class:`~miles.transport.base.StagedTransport` and
  ``rollout.overlap_weight_commit``: every rank *stages* version ``k`` (rank 0 snapshots the gathered
  weights in host memory, so the next step may change them), and a task on rank 0's event loop
  *commits* it — writes it while the engines keep generating, pauses, has the engines load it, continues,
  verifies — while the trainer already trains step ``k + 1``. Only the snapshot stays on the trainer's
  critical path. Commits run one at a time, in order; the next push, an evaluation, a checkpoint and the
  end of the run wait for the pending one (:meth:`WeightPublisher.flush`), so a verification failure stops
  the run at the latest one step later, with the tensor's name. When engines die during a commit and
  others are left, the version (still staged) is committed again to those; the engines stay paused until
  it is in. The group source learns version ``k`` when
  it is staged (the trainer holds it from then on) and that the engines serve it when the commit has
  loaded it: the staleness window follows the engines' version.

The other seam, where groups come from, is :mod:`miles.driver.sources`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from miles.errors import EngineError
from miles.rollout.protocol import LAUNCH_WEIGHT_VERSION
from miles.transport.base import StagedTransport

if TYPE_CHECKING:
    from miles.driver.sources import GroupSource
    from miles.rollout.client import EngineClient
    from miles.settings.model import MilesSettings
    from miles.training.trainer import DistContext, Trainer
    from miles.transport.base import WeightTransport
    from miles.types import PushReport

__all__ = ["InlinePublisher", "OverlappedPublisher", "PublishContext", "WeightPublisher"]

log = logging.getLogger(__name__)


class PublishContext(Protocol):
    """What a publisher needs from the training loop."""

    settings: MilesSettings
    dist: DistContext
    trainer: Trainer
    transport: WeightTransport | None
    client: EngineClient | None
    source: GroupSource | None

    def rollout_buckets(self) -> Iterator[list[tuple[str, Any]]]: ...

    async def randomize_engines(self, step: int) -> None: ...

    async def verify_push(self, report: PushReport, *, step: int) -> None: ...

    async def on_compute_thread(self, coro_fn: Callable[[], Awaitable[Any]]) -> Any: ...


class WeightPublisher(ABC):
    """Publishes each step's weights (every rank calls it, in step)."""

    def __init__(self, loop: PublishContext) -> None:
        self.loop = loop
        self.weight_version = LAUNCH_WEIGHT_VERSION
        """The version the trainer's weights were last published as."""

    @property
    def is_driver(self) -> bool:
        return self.loop.dist.rank == 0

    async def connect(self) -> None:
        """Once, on every rank, before the first push: give the transport this rank's trainer
        (:meth:`~miles.transport.base.WeightTransport.attach`) and connect it to the engines."""
        loop = self.loop
        if loop.transport is not None:
            loop.transport.attach(loop.trainer)
            await loop.transport.connect(loop.client, loop.dist)

    @abstractmethod
    async def publish(self, step: int) -> PushReport | None:
        """Publish the trainer's weights as version ``step`` (``None`` without a transport)."""

    async def republish(self) -> PushReport | None:
        """Push the version the trainer holds (:attr:`weight_version`) again, every rank: engines restarted
        while none served (:mod:`miles.rollout.failover`) take it, verified, and serve again."""
        return await self.publish(int(self.weight_version))

    async def flush(self) -> None:
        """Wait until what was published is served and verified (rank 0); a verification failure raises."""

    async def close(self) -> None:
        """Cancel what is pending (the run is ending)."""

    def metrics(self, report: PushReport | None) -> dict[str, float]:
        """The step's ``weight_sync/*`` metrics (rank 0)."""
        if report is None:
            return {}
        out = {
            "weight_sync/seconds": report.seconds,
            "weight_sync/bytes": float(report.num_bytes),
            "weight_sync/tensors": float(report.num_tensors),
        }
        out.update(report.metrics)
        out.update(report.verification)
        return out

    async def _check_engines(self) -> list[str]:
        """Rank 0, before a push: engines that died are left out of it, restarted ones take it and rejoin
        (:mod:`miles.rollout.failover`). Returns the engines that take the push (none on other ranks)."""
        if self.is_driver and self.loop.client is not None:
            await self.loop.client.check_engines()
            return list(self.loop.client.urls)
        return []

    async def _engines_lost(
        self, error: BaseException | None, before: list[str], version: str, retries: int, doing: str
    ) -> bool:
        """Rank 0, after a push or commit of ``version`` to ``before`` failed with ``error``: whether it failed
        (:class:`~miles.errors.EngineError`) because engines died during it (they no longer answer
        ``/health``) while others are left, or none is left but a restarted one answers again in time
        (:meth:`~miles.rollout.client.EngineClient.wait_for_a_restart`); then the whole version goes again to
        those. Each retry needs a new engine lost (a restart only as often as ``rollout.engine_restarts``),
        so the retries are bounded."""
        client = self.loop.client
        if not isinstance(error, EngineError) or client is None:
            return False
        await client.check_engines()
        lost = [url for url in before if url not in client.urls]
        if lost and not client.urls:
            log.error("%s; %s went down during the push and no engine is left", error, ", ".join(lost))
            await client.wait_for_a_restart()
        if not lost or not client.urls:
            return False
        log.error(
            "%s; %s went down during the push: %s weight version %s again to %s (retry %d)",
            error,
            ", ".join(lost),
            doing,
            version,
            ", ".join(client.urls),
            retries + 1,
        )
        return True

    def _weights_reached(self, version: str) -> None:
        """Rank 0, after a verified push: the engines that took it while rejoining serve again."""
        if self.is_driver and self.loop.client is not None:
            self.loop.client.weights_reached(version)

    async def _paused(self, work: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``work`` with the engines paused when the source is generating meanwhile (rank 0)."""
        loop, source = self.loop, self.loop.source
        paused = self.is_driver and loop.client is not None and source is not None and source.producing
        start = time.perf_counter()
        if paused:
            assert loop.client is not None
            await loop.client.pause_generation(loop.settings.rollout.pause_mode)
        try:
            return await work()
        finally:
            if paused:
                assert loop.client is not None and source is not None
                await loop.client.continue_generation()
                if hasattr(source, "pause_seconds"):
                    source.pause_seconds += time.perf_counter() - start


class InlinePublisher(WeightPublisher):
    """Push and verify within the step."""

    async def publish(self, step: int) -> PushReport | None:
        loop = self.loop
        if loop.transport is None:
            return None
        transport = loop.transport
        version = str(step)

        async def push() -> PushReport:
            retries = 0
            while True:
                before = await self._check_engines()
                await loop.randomize_engines(step)
                report, error = await self._push_once(transport, version)
                if not await self._push_again(error, before, version, retries):
                    break
                retries += 1
            if error is not None:
                raise error
            assert report is not None
            if retries:
                report.metrics["weight_sync/retries"] = float(retries)
            self.weight_version = version
            await loop.verify_push(report, step=step)
            self._weights_reached(version)
            return report

        report: PushReport = await self._paused(push)
        if self.is_driver and loop.source is not None:
            loop.source.weights_changed(int(self.weight_version))
        return report

    async def _push_once(self, transport: WeightTransport, version: str) -> tuple[PushReport | None, Exception | None]:
        """One push of ``version`` on every rank; a failure is returned, once the buckets are drained (each
        bucket is a collective of every rank: the others have gathered them all)."""
        loop = self.loop
        buckets = iter(loop.rollout_buckets())
        try:
            return await transport.push(buckets, version=version, dist=loop.dist), None
        except Exception as exc:
            if loop.dist.world_size > 1 and transport.reads_buckets:
                for _ in buckets:
                    pass
            return None, exc

    async def _push_again(self, error: Exception | None, before: list[str], version: str, retries: int) -> bool:
        """Every rank: whether to push ``version`` again, as rank 0 decides (:meth:`_engines_lost`)."""
        from miles.training.comm import broadcast_json

        again = self.is_driver and await self._engines_lost(error, before, version, retries, "pushing")
        return bool(broadcast_json(again))


class OverlappedPublisher(WeightPublisher):
    """Stage in the step, commit while the next step trains (see the module docstring)."""

    def __init__(self, loop: PublishContext) -> None:
        super().__init__(loop)
        self._commit: asyncio.Task[PushReport] | None = None
        self._committed: dict[str, float] = {}
        """Metrics of the last awaited commit, logged with the next step."""

    async def publish(self, step: int) -> PushReport | None:
        await self.flush()
        loop = self.loop
        transport = loop.transport
        assert isinstance(transport, StagedTransport)
        version = str(step)
        buckets = loop.rollout_buckets()
        report: PushReport = await loop.on_compute_thread(
            lambda: transport.stage(buckets, version=version, dist=loop.dist)
        )
        self.weight_version = version
        if self.is_driver:
            if loop.source is not None:  # the trainer holds the new version; the engines serve the old one
                loop.source.weights_changed(int(version), engines_follow=False)
            self._commit = asyncio.create_task(self._commit_version(report, step), name=f"commit-v{version}")
            if step >= loop.settings.train.num_rollouts:
                await self.flush()  # nothing left to overlap with: log the last version's verification
        return report

    async def _commit_version(self, report: PushReport, step: int) -> PushReport:
        """Rank 0, concurrently with the next training step: prepare, pause, load, continue, verify."""
        loop = self.loop
        transport = loop.transport
        assert isinstance(transport, StagedTransport)
        start = time.perf_counter()
        staged_seconds = report.seconds
        await transport.prepare(report)  # the engines keep generating while the weights are written
        pause_start = time.perf_counter()

        retries = 0

        async def load() -> None:
            nonlocal retries
            while True:
                before = await self._check_engines()
                if not retries:  # (once: a retry may deliver only to the engines that lack the version)
                    await loop.randomize_engines(step)
                try:
                    await transport.commit(report)
                    break
                except Exception as error:  # the version stays staged: it may be committed again
                    if not await self._engines_lost(error, before, report.version, retries, "committing"):
                        raise
                retries += 1
            if loop.source is not None:
                loop.source.engines_caught_up(int(report.version))

        await self._paused(load)
        loaded = time.perf_counter()
        await loop.verify_push(report, step=step)
        self._weights_reached(report.version)
        done = time.perf_counter()
        report.seconds = staged_seconds  # what the trainer waited for; the commit is reported apart
        self._committed = {
            **report.verification,
            "weight_sync/committed_version": float(report.version),
            "weight_sync/commit_seconds": done - start,
            "weight_sync/prepare_seconds": pause_start - start,
            "weight_sync/load_seconds": loaded - pause_start,
            "weight_sync/verify_seconds": done - loaded,
        }
        if retries:
            self._committed["weight_sync/retries"] = float(retries)
        return report

    async def flush(self) -> None:
        task, self._commit = self._commit, None
        if task is not None:
            await task

    async def close(self) -> None:
        task, self._commit = self._commit, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def metrics(self, report: PushReport | None) -> dict[str, float]:
        out = {k: v for k, v in super().metrics(report).items() if not k.startswith("weight_sync/verified")}
        out.update(self._committed)  # the previous version's commit, awaited by this step's push
        self._committed = {}
        return out
