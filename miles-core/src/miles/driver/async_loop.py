"""The asynchronous drivers: ``one_step_off`` and ``fully_async`` (``rollout.mode``).

Rank 0 runs a :class:`RolloutProducer` on its event loop: it keeps the engines busy generating groups
(through the rollout manager, its scorer and the algorithm's dynamic-sampling filter) into a
:class:`~miles.rollout.buffer.StalenessBuffer`, while the trainer takes one batch of groups per step from
the buffer and trains on it in a worker thread (so the producer's coroutines keep running). Around every
weight push the engines are paused (``rollout.pause_mode``: ``abort``, ``retract`` or ``in_place``, as
SGLang offers), then continued: requests in flight finish under the new weights and their samples carry
one weight-version span per version (the algorithm's TIS / IcePop settings correct or mask them).

- ``one_step_off``: the buffer holds one batch (``rollout_batch_size`` groups): batch ``i + 1`` is
  generated while batch ``i`` trains. Staleness is at most 1.
- ``fully_async``: a persistent producer with ``rollout.buffer_groups`` slots and the staleness window
  ``rollout.max_staleness``; stale groups are dropped or regenerated (``rollout.stale_policy``).

With a transport that stages weights (``disk``) and ``rollout.overlap_weight_commit`` (the default), a
push is split: every rank *stages* version ``k`` (rank 0 snapshots the gathered weights in host memory,
so the next step may change them), and a task on rank 0's event loop *commits* it — write it out while
the engines keep generating, pause, the engines load it, continue, verify — while the trainer already
trains step ``k + 1``. Only the snapshot stays on the trainer's critical path. Commits run one at a time,
in order; the next push, an evaluation, a checkpoint and the end of the run wait for the pending one, so
a verification failure stops the run at the latest one step later, with the tensor's name. The buffer
learns version ``k`` when it is staged (the trainer holds it from then on) and that the engines serve it
when the commit has loaded it: the staleness window follows the engines' version.

Every rank runs the same SPMD step as the synchronous loop; only rank 0 differs (where groups come from,
pausing around the push). The buffer's contents and the groups in flight are saved in checkpoints.

Threads: training and staging run on one dedicated thread with the process's torch thread count, while
the main thread (event loop, set-up, checkpoints) runs torch single-threaded. With OpenMP (torch's CPU
backend) every thread that runs parallel regions gets its own thread pool, and libgomp throttles
spin-waiting once a process has more pool threads than cores — the same kernels then run 1.4-1.7x slower
(measured on the local engine's decode). One multi-threaded torch thread per process avoids that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from miles.driver.loop import TrainingLoop
from miles.errors import SettingsError
from miles.rollout.buffer import StalenessBuffer, pending_group
from miles.transport.base import StagedTransport
from miles.types import SampleGroup

if TYPE_CHECKING:
    from miles.data.base import DataSource
    from miles.plugins.manager import PluginManager
    from miles.rollout.manager import RolloutManager
    from miles.settings.model import MilesSettings, RolloutSettings
    from miles.training.trainer import DistContext
    from miles.transport.base import PushReport

__all__ = ["AsyncTrainingLoop", "RolloutProducer", "buffer_for"]

log = logging.getLogger(__name__)


def buffer_for(rollout: RolloutSettings, *, num_rollouts: int) -> StalenessBuffer:
    """The buffer of an async mode, with the settings checked (errors name the field)."""
    batch = rollout.rollout_batch_size
    if rollout.mode == "one_step_off":
        if rollout.max_staleness < 1:
            raise SettingsError("rollout.max_staleness: one_step_off trains on batches one version old; set it >= 1")
        capacity, staleness = batch, 1
    elif rollout.mode == "fully_async":
        if rollout.buffer_groups < batch:
            raise SettingsError(
                f"rollout.buffer_groups: {rollout.buffer_groups} is smaller than rollout.rollout_batch_size = {batch}; "
                "the trainer could never take a batch"
            )
        capacity, staleness = rollout.buffer_groups, rollout.max_staleness
    else:
        raise SettingsError(f"rollout.mode: {rollout.mode!r} is not an async mode")
    return StalenessBuffer(
        capacity,
        max_staleness=staleness,
        stale_policy=rollout.stale_policy,
        batch_groups=batch,
        total_groups=batch * num_rollouts,
    )


class RolloutProducer:
    """Generates, scores and filters groups into a buffer until cancelled.

    :param max_filtered: groups the algorithm's filter may drop in a row before one is kept anyway (so
        an uninformative data set cannot stall the run; the synchronous manager does the same).
    """

    def __init__(
        self, manager: RolloutManager, data: DataSource, buffer: StalenessBuffer, *, max_filtered: int
    ) -> None:
        self.manager = manager
        self.data = data
        self.buffer = buffer
        self.max_filtered = max_filtered
        self.inflight: dict[int, SampleGroup] = {}
        """Groups being generated, as pending samples (checkpointed, regenerated on resume)."""
        self.tasks: set[asyncio.Task[None]] = set()
        self.generated = 0
        self.filtered = 0
        self._filtered_in_row = 0
        self._error: BaseException | None = None

    def _next_group(self) -> SampleGroup:
        retry = self.buffer.take_retry()
        if retry is not None:
            return retry
        (prompt,) = self.data.next_batch(1)
        samples = self.manager.new_group(prompt)
        return SampleGroup(samples[0].group_id, samples)

    async def run(self) -> None:
        """Reserve a slot, start a group, repeat; on any failure the buffer is closed with the error."""
        try:
            while True:
                await self.buffer.reserve()
                group = self._next_group()
                self.inflight[group.group_id] = group
                task = asyncio.create_task(self._one(group), name=f"rollout-group-{group.group_id}")
                self.tasks.add(task)
                task.add_done_callback(self._done)
        except BaseException as exc:
            self.buffer.close(exc if self._error is None else self._error)
            raise
        finally:
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
            self.buffer.close(self._error)

    async def _one(self, pending: SampleGroup) -> None:
        manager = self.manager
        try:
            samples = await asyncio.gather(*(manager.generate_sample(s) for s in pending.samples))
            group = SampleGroup(pending.group_id, list(samples))
            await manager.scorer(group.samples)
            keep = manager.algorithm.keep_groups([group])[0] if manager.algorithm is not None else True
        except BaseException:
            self.inflight.pop(pending.group_id, None)
            self.buffer.release()
            raise
        # from here to put() nothing awaits: a checkpoint sees the group either in flight or in the buffer
        self.inflight.pop(pending.group_id, None)
        self.generated += 1
        if not keep and self._filtered_in_row < self.max_filtered:
            self._filtered_in_row += 1
            self.filtered += 1
            self.buffer.release()
            return
        if not keep:
            log.warning(
                "dynamic sampling dropped %d groups in a row; keeping group %d anyway",
                self._filtered_in_row,
                group.group_id,
            )
        self._filtered_in_row = 0
        await self.buffer.put(group, reserved=True)

    def metrics(self) -> dict[str, float]:
        """Counters since the last call."""
        out = {"rollout/groups_generated": float(self.generated), "rollout/groups_dropped": float(self.filtered)}
        self.generated = self.filtered = 0
        return out


class AsyncTrainingLoop(TrainingLoop):
    """:class:`TrainingLoop` with rollout overlapped with training (see the module docstring)."""

    def __init__(
        self,
        settings: MilesSettings,
        pm: PluginManager,
        dist: DistContext,
        *,
        engine_urls: list[str],
        resume: str | None = None,
    ) -> None:
        import torch

        self.train_threads = torch.get_num_threads()
        torch.set_num_threads(1)  # before the trainer is built: see "Threads" in the module docstring
        self._torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-train")
        super().__init__(settings, pm, dist, engine_urls=engine_urls, resume=resume)
        self.buffer = buffer_for(settings.rollout, num_rollouts=settings.train.num_rollouts)
        self.producer: RolloutProducer | None = None
        self._producer_task: asyncio.Task[None] | None = None
        self._last_obtain = time.perf_counter()
        self._pause_seconds = 0.0
        self._commit_task: asyncio.Task[PushReport] | None = None
        self._committed: dict[str, float] = {}
        """Metrics of the last awaited commit, logged with the next step."""

    @property
    def producing(self) -> bool:
        return self._producer_task is not None and not self._producer_task.done()

    # -- the loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        await self._await_commit()  # a resumed run's first push: generate on the checkpoint's weights
        if self.is_driver and self.algorithm.needs.rollout and self.manager is not None:
            assert self.data is not None
            self.buffer.set_version(self.step)
            self.producer = RolloutProducer(
                self.manager,
                self.data,
                self.buffer,
                max_filtered=self.manager.max_rounds * self.settings.rollout.rollout_batch_size,
            )
            self._last_obtain = time.perf_counter()
            self._producer_task = asyncio.create_task(self.producer.run(), name="rollout-producer")
            log.info(
                "%s rollout: buffer of %d groups, max staleness %d (%s), pause mode %s",
                self.settings.rollout.mode, self.buffer.capacity, self.buffer.max_staleness,
                self.buffer.stale_policy, self.settings.rollout.pause_mode,
            )  # fmt: skip
        try:
            await super().run()
            await self._await_commit()
        finally:
            await self._stop_producer()
            if self._commit_task is not None and not self._commit_task.done():
                self._commit_task.cancel()
                await asyncio.gather(self._commit_task, return_exceptions=True)

    async def _stop_producer(self) -> None:
        task, self._producer_task = self._producer_task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if self.client is not None:
            try:  # the engines keep generating what the cancelled requests asked for otherwise
                await self.client.abort()
            except Exception as exc:
                log.warning("could not abort the engines' requests: %s", exc)

    async def obtain_groups(self, metrics: dict[str, float]) -> list[dict[str, Any]]:
        if self.producer is None:  # SFT: nothing to overlap
            return await super().obtain_groups(metrics)
        assert self.manager is not None
        groups = await self.buffer.get(self.settings.rollout.rollout_batch_size)
        now = time.perf_counter()
        seconds, self._last_obtain = now - self._last_obtain, now
        metrics.update(self.manager._metrics(groups, 0, 1, seconds))  # reward, lengths, versions, cache
        metrics.update(self.producer.metrics())
        metrics.update(self.buffer.metrics())
        metrics["async/pause_seconds"] = self._pause_seconds
        metrics["async/partial_samples"] = float(sum(len(s.weight_versions) > 1 for g in groups for s in g.samples))
        self._pause_seconds = 0.0
        self.record_rollout(groups, metrics)
        return [g.to_dict() for g in groups]

    async def _on_torch_thread(self, coro_fn: Any) -> Any:
        """Run ``coro_fn()`` to completion on the training thread (with the process's torch threads)."""
        import torch

        def work() -> Any:
            torch.set_num_threads(self.train_threads)
            return asyncio.run(coro_fn())

        return await asyncio.get_running_loop().run_in_executor(self._torch_thread, work)

    async def train_on(self, groups: list[SampleGroup]) -> dict[str, float]:
        """Train on the training thread: rank 0's event loop keeps feeding the engines meanwhile."""
        parent = super().train_on
        result: dict[str, float] = await self._on_torch_thread(lambda: parent(groups))
        return result

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            self._torch_thread.shutdown(wait=False)

    @property
    def overlaps_commit(self) -> bool:
        """Whether pushes are staged here and committed while the next step trains (same on every rank)."""
        transport = self.transport
        return (
            transport is not None
            and isinstance(transport, StagedTransport)
            and self.settings.rollout.overlap_weight_commit
            and self.algorithm.needs.rollout
            and not self.settings.cluster.colocate
        )

    async def push_weights(self) -> PushReport | None:
        """Pause the engines (``rollout.pause_mode``), push, continue; the buffer learns the new version.

        When :attr:`overlaps_commit`, only the staging happens here; see the module docstring."""
        await self._await_commit()
        if self.overlaps_commit:
            return await self._stage_and_commit_later()
        paused = self.is_driver and self.client is not None and self.producing and self.transport is not None
        start = time.perf_counter()
        if paused:
            assert self.client is not None
            await self.client.pause_generation(self.settings.rollout.pause_mode)
        try:
            report = await super().push_weights()
        finally:
            if paused:
                assert self.client is not None
                await self.client.continue_generation()
                self._pause_seconds += time.perf_counter() - start
        if self.is_driver:
            self.buffer.set_version(int(self.weight_version))
        return report

    async def _stage_and_commit_later(self) -> PushReport:
        transport = self.transport
        assert isinstance(transport, StagedTransport)
        version = str(self.step)
        buckets = self.rollout_buckets()
        report: PushReport = await self._on_torch_thread(
            lambda: transport.stage(buckets, version=version, dist=self.dist)
        )
        self.weight_version = version
        if self.is_driver:
            # the trainer holds the new version; the engines serve the previous one until the commit
            self.buffer.set_version(int(version), engines=self.buffer.engine_version)
            self._commit_task = asyncio.create_task(self._commit(report, self.step), name=f"commit-v{version}")
            if self.step >= self.settings.train.num_rollouts:
                await self._await_commit()  # nothing left to overlap with: log the last version's verification
        return report

    async def _commit(self, report: PushReport, step: int) -> PushReport:
        """Rank 0, concurrently with the next training step: prepare, pause, load, continue, verify."""
        transport = self.transport
        assert isinstance(transport, StagedTransport)
        paused = self.client is not None and self.producing
        start = time.perf_counter()
        staged_seconds = report.seconds
        await transport.prepare(report)  # the engines keep generating while the weights are written
        pause_start = time.perf_counter()
        if paused:
            assert self.client is not None
            await self.client.pause_generation(self.settings.rollout.pause_mode)
        try:
            await self.randomize_engines(step)
            await transport.commit(report)
            self.buffer.set_engine_version(int(report.version))
        finally:
            if paused:
                assert self.client is not None
                await self.client.continue_generation()
                self._pause_seconds += time.perf_counter() - pause_start
        loaded = time.perf_counter()
        await self.verify_push(report, step=step)
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
        return report

    async def _await_commit(self) -> None:
        """Wait for the pending commit (rank 0); a verification failure raises here."""
        task, self._commit_task = self._commit_task, None
        if task is not None:
            await task

    def _sync_metrics(self, report: PushReport | None) -> dict[str, float]:
        out = super()._sync_metrics(report)
        if self.overlaps_commit:
            out = {k: v for k, v in out.items() if not k.startswith("weight_sync/verified")}
            out.update(self._committed)  # the previous version's commit, awaited by this step's push
            self._committed = {}
        return out

    async def maybe_evaluate(self) -> dict[str, float]:
        interval = self.settings.train.eval_interval
        if interval is not None and (self.step % interval == 0 or self.step == self.settings.train.num_rollouts):
            await self._await_commit()  # evaluate the version just pushed
        return await super().maybe_evaluate()

    async def save(self) -> None:
        await self._await_commit()
        await super().save()

    # -- checkpoints -------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        inflight = list(self.producer.inflight.values()) if self.producer is not None else []
        return {
            "mode": self.settings.rollout.mode,
            "buffer": self.buffer.state_dict(),
            "inflight": [pending_group(g).to_dict() for g in inflight],
        }

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        if "buffer" not in extra:
            log.info(
                "the checkpoint has no rollout buffer (saved by a %s run); starting empty", extra.get("mode", "sync")
            )
            self.buffer.consumed = self.step * self.settings.rollout.rollout_batch_size
            return
        inflight = [SampleGroup.from_dict(g) for g in extra.get("inflight", [])]
        self.buffer.load_state_dict(extra["buffer"], pending=inflight)
        log.info(
            "restored the rollout buffer: %d groups ready, %d to regenerate (%d were in flight)",
            len(self.buffer.ready), len(self.buffer.retry), len(inflight),
        )  # fmt: skip
