"""Where each training step's groups come from (rank 0): one of the training loop's two seams.

- :class:`SFTBatches`: data rows and their target responses, no engine.
- :class:`InlineRollout`: ``sync`` mode — the rollout manager generates the step's groups, then training
  starts.
- :class:`BufferedRollout`: ``one_step_off`` / ``fully_async`` — a
  :class:`~miles.rollout.producer.RolloutProducer` keeps generating into a staleness buffer while the
  trainer trains; a step takes one batch from the buffer. The buffer and the groups in flight are
  checkpointed.

The other seam, how weights are published, is :mod:`miles.driver.publish`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from miles.rollout.buffer import pending_group
from miles.types import SampleGroup

if TYPE_CHECKING:
    from miles.data.base import DataSource
    from miles.rollout.buffer import StalenessBuffer
    from miles.rollout.client import EngineClient
    from miles.rollout.manager import RolloutManager
    from miles.rollout.producer import RolloutProducer
    from miles.settings.model import MilesSettings

__all__ = ["BufferedRollout", "GroupSource", "InlineRollout", "SFTBatches", "group_source_for"]

log = logging.getLogger(__name__)


class GroupSource(ABC):
    """The groups of every step, on rank 0."""

    generates = True
    """Whether the groups come from the engines (their samples are kept on disk and handed to
    ``miles_on_rollout_end``); ``False`` for data rows."""

    @property
    def producing(self) -> bool:
        """Whether generation runs while the trainer trains (the engines are paused around weight loads)."""
        return False

    async def start(self, step: int) -> None:
        """Called once before the first step (``step`` steps are done)."""

    @abstractmethod
    async def next_groups(self, step: int, metrics: dict[str, float]) -> list[SampleGroup]:
        """The groups of step ``step + 1``; adds rollout metrics to ``metrics``."""

    async def stop(self) -> None:
        """Called once when the run ends, whatever the reason."""

    def weights_changed(self, trainer: int, *, engines_follow: bool = True) -> None:
        """The trainer now holds weight version ``trainer``; the engines serve it too unless
        ``engines_follow`` is false (a staged push: they keep their version until
        :meth:`engines_caught_up`)."""

    def engines_caught_up(self, version: int) -> None:
        """The engines now serve version ``version`` (a staged push was committed)."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpointed beside the data position (``DriverState.extra``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any], *, step: int) -> None:
        """Restore :meth:`state_dict` (``state`` may come from a run in another mode)."""


class SFTBatches(GroupSource):
    """Supervised rows: each step takes ``rollout_batch_size`` rows as single-sample groups."""

    generates = False

    def __init__(self, data: DataSource, tokenizer: Any, *, batch_size: int) -> None:
        self.data = data
        self.tokenizer = tokenizer
        self.batch_size = batch_size

    async def next_groups(self, step: int, metrics: dict[str, float]) -> list[SampleGroup]:
        from miles.driver.sft import sft_groups

        prompts = self.data.next_batch(self.batch_size)
        groups = sft_groups(prompts, self.tokenizer, first_group_id=step * self.batch_size, weight_version=step)
        metrics["sft/response_tokens"] = float(sum(s.response_length for g in groups for s in g.samples))
        return groups


class InlineRollout(GroupSource):
    """``sync``: one rollout per step through the manager, before training."""

    def __init__(self, manager: RolloutManager, data: DataSource) -> None:
        self.manager = manager
        self.data = data

    async def next_groups(self, step: int, metrics: dict[str, float]) -> list[SampleGroup]:
        result = await self.manager.rollout(self.data)
        metrics.update(result.metrics)
        return result.groups


class BufferedRollout(GroupSource):
    """``one_step_off`` / ``fully_async``: a producer fills a staleness buffer while the trainer trains."""

    def __init__(
        self, manager: RolloutManager, data: DataSource, buffer: StalenessBuffer, client: EngineClient, *, mode: str
    ) -> None:
        self.manager = manager
        self.data = data
        self.buffer = buffer
        self.client = client
        self.mode = mode
        self.producer: RolloutProducer | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_take = time.perf_counter()
        self.pause_seconds = 0.0
        """Seconds the engines were paused for weight loads since the last step (the publisher adds)."""

    @property
    def producing(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self, step: int) -> None:
        from miles.rollout.producer import RolloutProducer

        self.buffer.set_version(step)
        self.producer = RolloutProducer(self.manager, self.data, self.buffer)
        self._last_take = time.perf_counter()
        self._task = asyncio.create_task(self.producer.run(), name="rollout-producer")
        log.info(
            "%s rollout: buffer of %d groups, max staleness %d (%s), pause mode %s",
            self.mode, self.buffer.capacity, self.buffer.max_staleness, self.buffer.stale_policy,
            self.manager.settings.pause_mode,
        )  # fmt: skip

    async def next_groups(self, step: int, metrics: dict[str, float]) -> list[SampleGroup]:
        assert self.producer is not None, "BufferedRollout.start() was not called"
        groups = await self.buffer.get(self.manager.settings.rollout_batch_size)
        now = time.perf_counter()
        seconds, self._last_take = now - self._last_take, now
        metrics.update(self.manager.batch_metrics(groups, seconds=seconds))  # reward, lengths, versions, cache
        metrics.update(self.producer.metrics())
        metrics.update(self.buffer.metrics())
        metrics["async/pause_seconds"] = self.pause_seconds
        metrics["async/partial_samples"] = float(sum(len(s.weight_versions) > 1 for g in groups for s in g.samples))
        self.pause_seconds = 0.0
        return groups

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        try:  # the engines keep generating what the cancelled requests asked for otherwise
            await self.client.abort()
        except Exception as exc:
            log.warning("could not abort the engines' requests: %s", exc)

    def weights_changed(self, trainer: int, *, engines_follow: bool = True) -> None:
        self.buffer.set_version(trainer, engines=None if engines_follow else self.buffer.engine_version)

    def engines_caught_up(self, version: int) -> None:
        self.buffer.set_engine_version(version)

    def state_dict(self) -> dict[str, Any]:
        inflight = list(self.producer.inflight.values()) if self.producer is not None else []
        return {
            "mode": self.mode,
            "buffer": self.buffer.state_dict(),
            "inflight": [pending_group(g).to_dict() for g in inflight],
        }

    def load_state_dict(self, state: dict[str, Any], *, step: int) -> None:
        if "buffer" not in state:
            log.info(
                "the checkpoint has no rollout buffer (saved by a %s run); starting empty", state.get("mode", "sync")
            )
            self.buffer.consumed = step * self.manager.settings.rollout_batch_size
            return
        inflight = [SampleGroup.from_dict(g) for g in state.get("inflight", [])]
        self.buffer.load_state_dict(state["buffer"], pending=inflight)
        log.info(
            "restored the rollout buffer: %d groups ready, %d to regenerate (%d were in flight)",
            len(self.buffer.ready), len(self.buffer.retry), len(inflight),
        )  # fmt: skip


def group_source_for(
    settings: MilesSettings,
    *,
    data: DataSource,
    tokenizer: Any,
    manager: RolloutManager | None,
    client: EngineClient | None,
    needs_rollout: bool,
) -> GroupSource | None:
    """The group source of the run's mode (rank 0): data rows for an algorithm that needs no rollout (SFT),
    the inline rollout in ``sync`` mode, a producer filling a staleness buffer in the async modes; ``None``
    without a rollout stack (no engines)."""
    if not needs_rollout:
        return SFTBatches(data, tokenizer, batch_size=settings.rollout.rollout_batch_size)
    if manager is None or client is None:
        return None
    if settings.rollout.mode == "sync":
        return InlineRollout(manager, data)
    from miles.rollout.producer import buffer_for

    buffer = buffer_for(settings.rollout, num_rollouts=settings.train.num_rollouts)
    return BufferedRollout(manager, data, buffer, client, mode=settings.rollout.mode)
