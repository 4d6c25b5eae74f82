"""The asynchronous modes' rollout side: a producer that keeps the engines busy filling a staleness buffer.

:class:`RolloutProducer` reserves a slot of the :class:`~miles.rollout.buffer.StalenessBuffer`, starts a
group (a retried stale one first, else the next prompt's), and when the group is produced — generated,
scored and judged by the same :meth:`RolloutManager.produce_group` the synchronous rollout uses — admits
it through the manager's :class:`~miles.rollout.manager.DropBudget`. :func:`buffer_for` sizes the buffer
for ``one_step_off`` and ``fully_async``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from miles.errors import SettingsError
from miles.rollout.buffer import StalenessBuffer
from miles.types import SampleGroup

if TYPE_CHECKING:
    from miles.data.base import DataSource
    from miles.rollout.manager import RolloutManager
    from miles.settings.model import RolloutSettings

__all__ = ["RolloutProducer", "buffer_for"]

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

    :param max_filtered: groups the algorithm's filter may drop in a row before one is kept anyway
        (default: the manager's budget, ``max_rounds x rollout_batch_size``).
    """

    def __init__(
        self, manager: RolloutManager, data: DataSource, buffer: StalenessBuffer, *, max_filtered: int | None = None
    ) -> None:
        self.manager = manager
        self.data = data
        self.buffer = buffer
        self.budget = manager.budget
        if max_filtered is not None:
            self.budget.limit = max_filtered
        self.inflight: dict[int, SampleGroup] = {}
        """Groups being generated, as pending samples (checkpointed, regenerated on resume)."""
        self.tasks: set[asyncio.Task[None]] = set()
        self.generated = 0
        self._error: BaseException | None = None

    def _next_group(self) -> SampleGroup:
        retry = self.buffer.take_retry()
        if retry is not None:
            return retry
        (prompt,) = self.data.next_batch(1)
        return self.manager.pending_group(prompt)

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
        try:
            group, informative = await self.manager.produce_group(pending)
        except BaseException:
            self.inflight.pop(pending.group_id, None)
            self.buffer.release()
            raise
        # from here to put() nothing awaits: a checkpoint sees the group either in flight or in the buffer
        self.inflight.pop(pending.group_id, None)
        self.generated += 1
        if not self.budget.admit(group, informative):
            self.buffer.release()
            return
        await self.buffer.put(group, reserved=True)

    def metrics(self) -> dict[str, float]:
        """Counters since the last call."""
        out = {
            "rollout/groups_generated": float(self.generated),
            "rollout/groups_dropped": float(self.budget.take_dropped()),
        }
        self.generated = 0
        return out
