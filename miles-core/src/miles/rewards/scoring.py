"""Scoring samples with several weighted reward functions, with a timeout and a concurrency bound.

The rollout manager calls :func:`score_samples`. A reward function that raises or exceeds the timeout
marks the sample :attr:`~miles.types.SampleStatus.FAILED` with the reason in ``status_reason``; it never
stops the run.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from miles.rewards.base import Reward, RewardOutput
from miles.types import Sample, SampleStatus

__all__ = ["NamedReward", "RewardScorer", "Scorer", "close_rewards", "score_sample", "score_samples"]

logger = logging.getLogger(__name__)

NamedReward = tuple[str, Reward[Any], float]
"""``(name, reward, weight)``: the name keys ``Sample.reward_parts``."""

Scorer = Callable[[Sequence[Sample]], Awaitable[None]]
"""Fills ``reward`` / ``reward_parts`` (or marks samples failed) for a list of samples."""

_SKIP = (SampleStatus.FAILED, SampleStatus.ABORTED, SampleStatus.PENDING)


async def close_rewards(rewards: Sequence[NamedReward]) -> None:
    """Close every reward (HTTP clients ...)."""
    for _, reward, _ in rewards:
        await reward.close()


async def score_sample(sample: Sample, rewards: Sequence[NamedReward], timeout: float) -> None:
    """Score one sample with every function: ``reward = sum(weight * value)``, ``reward_parts[name] = value``
    (and ``reward_parts["name/part"]`` for named parts). The first failure marks the sample failed."""
    total = 0.0
    parts: dict[str, float] = {}
    for name, reward, weight in rewards:
        try:
            value = await asyncio.wait_for(reward.score(sample), timeout)
        except asyncio.TimeoutError:
            _fail(sample, parts, f"reward {name!r} timed out after {timeout:g}s")
            return
        except Exception as exc:
            _fail(sample, parts, f"reward {name!r} raised {type(exc).__name__}: {exc}")
            return
        if isinstance(value, RewardOutput):
            for part, v in value.parts.items():
                parts[f"{name}/{part}"] = float(v)
            value = value.value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            _fail(sample, parts, f"reward {name!r} returned {value!r}, not a finite number")
            return
        parts[name] = float(value)
        total += weight * float(value)
    sample.reward = total
    sample.reward_parts = parts


def _fail(sample: Sample, parts: dict[str, float], reason: str) -> None:
    logger.warning("sample %d/%d: %s", sample.group_id, sample.index, reason)
    sample.status = SampleStatus.FAILED
    sample.status_reason = reason
    sample.reward = None
    sample.reward_parts = parts


async def score_samples(
    samples: Sequence[Sample],
    rewards: Sequence[NamedReward],
    timeout: float,
    max_concurrency: int = 64,
    *,
    semaphore: asyncio.Semaphore | None = None,
) -> None:
    """Score ``samples`` in place, at most ``max_concurrency`` at once (or as many as ``semaphore``
    admits, shared with other calls); each function call is bounded by ``timeout`` seconds. Samples
    already failed, aborted or pending are left as they are."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    bound = semaphore if semaphore is not None else asyncio.Semaphore(max_concurrency)

    async def one(sample: Sample) -> None:
        async with bound:
            await score_sample(sample, rewards, timeout)

    await asyncio.gather(*(one(s) for s in samples if s.status not in _SKIP))


class RewardScorer:
    """The run's :data:`Scorer`: its reward functions, the timeout, and one concurrency bound shared by
    every call (so groups scored at once never exceed ``max_concurrency`` together)."""

    def __init__(self, rewards: Sequence[NamedReward], *, timeout: float, max_concurrency: int) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.rewards = list(rewards)
        self.timeout = timeout
        self.max_concurrency = max_concurrency
        self._semaphore: asyncio.Semaphore | None = None

    async def __call__(self, samples: Sequence[Sample]) -> None:
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        await score_samples(samples, self.rewards, self.timeout, self.max_concurrency, semaphore=self._semaphore)

    async def close(self) -> None:
        """Close every reward (HTTP clients ...)."""
        await close_rewards(self.rewards)
