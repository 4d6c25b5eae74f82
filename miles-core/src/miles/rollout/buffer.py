"""The rollout buffer of the asynchronous modes: bounded, staleness-checked, saved in checkpoints.

A producer (the rollout side) fills it with scored sample groups while the trainer drains it one batch at a
time. Three rules keep the data on-policy enough and the memory bounded:

- **capacity**: at most ``capacity`` groups are either ready in the buffer or being generated (a
  producer *reserves* a slot before it starts a group, so backpressure stops generation itself, not only
  the hand-over);
- **staleness window** (as AReaL does it): a slot is granted only while
  ``consumed + ready + in flight < (engine_version + max_staleness + 1) x batch_groups``, so a group
  started now (by engines serving ``engine_version``) is consumed by the time the trainer is at most
  ``max_staleness`` versions further. The engines' version is the trainer's, except while a pushed
  version is still being loaded (a commit overlapped with training);
- **admission control**: a group whose oldest weight version (:attr:`Sample.oldest_weight_version`)
  is more than ``max_staleness`` behind the trainer's current version is never handed out. It is
  checked when the group arrives and again when the trainer takes it (the version moves while it
  waits); ``stale_policy`` says whether it is dropped or queued for regeneration.

The staleness of every sample handed to the trainer is counted in a histogram. The buffer lives on one
asyncio event loop; its methods are not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from miles.types import Sample, SampleGroup

__all__ = ["BufferClosedError", "StalePolicy", "StalenessBuffer", "group_staleness", "pending_group"]

log = logging.getLogger(__name__)

StalePolicy = Literal["drop", "retry"]


class BufferClosedError(RuntimeError):
    """The buffer was closed (or its producer failed) while someone waited on it."""


def sample_staleness(sample: Sample, version: int) -> int:
    """Versions between the trainer's ``version`` and the oldest weights that produced ``sample`` (0 if unknown)."""
    oldest = sample.oldest_weight_version
    return 0 if oldest is None else max(version - oldest, 0)


def group_staleness(group: SampleGroup, version: int) -> int:
    """The staleness of a group: that of its stalest sample."""
    return max((sample_staleness(s, version) for s in group.samples), default=0)


def pending_group(group: SampleGroup) -> SampleGroup:
    """The group's samples reset to prompts (no response, reward or versions), ready to be regenerated."""
    samples = [
        Sample(
            prompt_ids=list(s.prompt_ids),
            group_id=s.group_id,
            index=s.index,
            prompt=s.prompt,
            prompt_messages=s.prompt_messages,
            label=s.label,
            metadata={k: v for k, v in s.metadata.items() if k not in ("cached_tokens", "prompt_tokens", "engine")},
        )
        for s in group.samples
    ]
    return SampleGroup(group.group_id, samples)


@dataclass
class _Window:
    """Counters since the last :meth:`StalenessBuffer.metrics` call."""

    histogram: dict[int, int] = field(default_factory=dict)
    producer_wait: float = 0.0
    trainer_wait: float = 0.0
    dropped: int = 0
    retried: int = 0
    admitted: int = 0


class StalenessBuffer:
    """A bounded FIFO of sample groups with staleness admission control.

    :param capacity: groups ready plus groups reserved (being generated), at most.
    :param max_staleness: largest ``version - oldest weight version`` a trained sample may have.
    :param stale_policy: ``drop`` a stale group, or ``retry`` it (see :meth:`take_retry`).
    :param batch_groups: groups the trainer takes per step (the unit of the staleness window); ``None``
        turns the window off (capacity and admission control only).
    :param total_groups: groups the run will consume in all; no slot is granted beyond it.
    """

    def __init__(
        self,
        capacity: int,
        *,
        max_staleness: int,
        stale_policy: StalePolicy = "drop",
        batch_groups: int | None = None,
        total_groups: int | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if stale_policy not in ("drop", "retry"):
            raise ValueError(f"stale_policy must be 'drop' or 'retry', got {stale_policy!r}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.stale_policy: StalePolicy = stale_policy
        self.batch_groups = batch_groups
        self.total_groups = total_groups
        self.version = 0
        """The trainer's current weight version."""
        self.engine_version = 0
        """The version the engines serve (behind :attr:`version` while a push is being committed)."""
        self.consumed = 0
        """Groups handed to the trainer so far."""
        self.reserved = 0
        """Slots held by groups being generated."""
        self.ready: deque[SampleGroup] = deque()
        self.retry: deque[SampleGroup] = deque()
        """Stale groups (policy ``retry``) and restored in-flight groups, as pending samples to regenerate."""
        self.histogram: dict[int, int] = {}
        """Samples handed to the trainer, by staleness (whole run)."""
        self.dropped = 0
        self.retried = 0
        self._window = _Window()
        self._changed = asyncio.Event()
        self._error: BaseException | None = None

    # -- state -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ready)

    @property
    def free_slots(self) -> int:
        """Slots a producer may reserve now (capacity and staleness window)."""
        free = self.capacity - len(self.ready) - self.reserved
        if self.batch_groups is not None:
            window = (self.engine_version + self.max_staleness + 1) * self.batch_groups
            if self.total_groups is not None:
                window = min(window, self.total_groups)
            free = min(free, window - self.consumed - len(self.ready) - self.reserved)
        elif self.total_groups is not None:
            free = min(free, self.total_groups - self.consumed - len(self.ready) - self.reserved)
        return free

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self) -> None:
        if self._error is not None:
            raise BufferClosedError(str(self._error)) from self._error
        await self._changed.wait()
        if self._error is not None:
            raise BufferClosedError(str(self._error)) from self._error

    def close(self, error: BaseException | None = None) -> None:
        """Wake every waiter with :class:`BufferClosedError` (``error``: why, e.g. the producer's exception)."""
        self._error = error or BufferClosedError("buffer closed")
        self._notify()

    # -- producer side -----------------------------------------------------------------------------
    async def reserve(self) -> None:
        """Wait for a free slot and hold it (backpressure); :meth:`put` or :meth:`release` gives it back."""
        start = time.perf_counter()
        if self._error is not None:
            raise BufferClosedError(str(self._error)) from self._error
        while self.free_slots <= 0:
            await self._wait_change()
        self.reserved += 1
        self._window.producer_wait += time.perf_counter() - start

    def release(self) -> None:
        """Give back a reserved slot without a group (it failed or a filter dropped it)."""
        if self.reserved <= 0:
            raise RuntimeError("StalenessBuffer.release() without a reservation")
        self.reserved -= 1
        self._notify()

    async def put(self, group: SampleGroup, *, reserved: bool = False) -> bool:
        """Offer a scored group; returns whether it was admitted.

        :param reserved: the caller holds a slot from :meth:`reserve` (else this waits for one).
        """
        if not reserved:
            await self.reserve()
        self.reserved -= 1
        admitted = self._admit(group)
        self._notify()
        return admitted

    def take_retry(self) -> SampleGroup | None:
        """The next group to regenerate (stale under policy ``retry``, or in flight at a checkpoint)."""
        return self.retry.popleft() if self.retry else None

    def _admit(self, group: SampleGroup) -> bool:
        staleness = group_staleness(group, self.version)
        if staleness <= self.max_staleness:
            self.ready.append(group)
            self._window.admitted += 1
            return True
        self._reject(group, staleness)
        return False

    def _reject(self, group: SampleGroup, staleness: int) -> None:
        if self.stale_policy == "retry":
            self.retried += 1
            self._window.retried += 1
            self.retry.append(pending_group(group))
        else:
            self.dropped += 1
            self._window.dropped += 1
        log.info(
            "group %d is %d versions stale (max %d, trainer at %d): %s",
            group.group_id, staleness, self.max_staleness, self.version,
            "queued for regeneration" if self.stale_policy == "retry" else "dropped",
        )  # fmt: skip

    # -- trainer side ------------------------------------------------------------------------------
    def set_version(self, version: int, *, engines: int | None = None) -> None:
        """The trainer now holds weight ``version``: evict groups that became stale, widen the window.

        :param engines: the version the engines serve, when they do not serve ``version`` yet (a commit
            overlapped with training); default ``version``."""
        self.version = int(version)
        self.engine_version = self.version if engines is None else min(int(engines), self.version)
        self._evict()
        self._notify()

    def set_engine_version(self, version: int) -> None:
        """The engines now serve ``version`` (a commit finished): the staleness window moves on."""
        self.engine_version = min(int(version), self.version)
        self._notify()

    def _evict(self) -> None:
        keep: deque[SampleGroup] = deque()
        for group in self.ready:
            staleness = group_staleness(group, self.version)
            if staleness <= self.max_staleness:
                keep.append(group)
            else:
                self._reject(group, staleness)
        if len(keep) != len(self.ready):
            self.ready = keep
            self._notify()  # slots (and maybe retries) for the producer

    async def get(self, n: int) -> list[SampleGroup]:
        """The ``n`` oldest admitted groups, waiting until there are that many; none is stale."""
        if n > self.capacity:
            raise ValueError(f"cannot take {n} groups from a buffer of capacity {self.capacity}")
        start = time.perf_counter()
        self._evict()
        while len(self.ready) < n:
            await self._wait_change()
            self._evict()
        out = [self.ready.popleft() for _ in range(n)]
        self.consumed += n
        for group in out:
            for sample in group.samples:
                k = sample_staleness(sample, self.version)
                self.histogram[k] = self.histogram.get(k, 0) + 1
                self._window.histogram[k] = self._window.histogram.get(k, 0) + 1
        self._window.trainer_wait += time.perf_counter() - start
        self._notify()
        return out

    # -- metrics and checkpoints -------------------------------------------------------------------
    def metrics(self, *, reset: bool = True) -> dict[str, float]:
        """``async/*`` metrics since the last call: fill level, waits, staleness histogram, drops."""
        w = self._window
        samples = sum(w.histogram.values())
        out = {
            "async/buffer_fill": float(len(self.ready)),
            "async/buffer_fill_fraction": len(self.ready) / self.capacity,
            "async/inflight_groups": float(self.reserved),
            "async/producer_wait_seconds": w.producer_wait,
            "async/trainer_wait_seconds": w.trainer_wait,
            "async/admitted_groups": float(w.admitted),
            "async/stale_dropped_groups": float(w.dropped),
            "async/stale_retried_groups": float(w.retried),
            "async/staleness_mean": sum(k * c for k, c in w.histogram.items()) / max(samples, 1),
            "async/staleness_max": float(max(w.histogram, default=0)),
        }
        for k in range(max(self.max_staleness, max(w.histogram, default=0)) + 1):
            out[f"async/staleness_{k}"] = float(w.histogram.get(k, 0))
        if reset:
            self._window = _Window()
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable contents: ready and retry groups, counters, the staleness histogram."""
        return {
            "version": self.version,
            "consumed": self.consumed,
            "ready": [g.to_dict() for g in self.ready],
            "retry": [g.to_dict() for g in self.retry],
            "histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "dropped": self.dropped,
            "retried": self.retried,
        }

    def load_state_dict(self, state: dict[str, Any], *, pending: Iterable[SampleGroup] = ()) -> None:
        """Restore :meth:`state_dict`; ``pending`` groups (in flight when it was saved) are regenerated."""
        self.version = self.engine_version = int(state["version"])
        self.consumed = int(state["consumed"])
        self.ready = deque(SampleGroup.from_dict(g) for g in state["ready"])
        self.retry = deque(SampleGroup.from_dict(g) for g in state["retry"])
        self.retry.extend(pending_group(g) for g in pending)
        self.histogram = {int(k): int(v) for k, v in state["histogram"].items()}
        self.dropped = int(state["dropped"])
        self.retried = int(state["retried"])
        self.reserved = 0
        self._notify()
