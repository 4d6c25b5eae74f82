"""Scoring samples with several weighted reward functions, with a timeout and a concurrency bound.

The rollout manager calls :func:`score_samples` with the samples of one group. A reward function that raises
or exceeds the timeout marks the sample :attr:`~miles.types.SampleStatus.FAILED` with the reason in
``status_reason``; it never stops the run. A group reward (:class:`~miles.rewards.base.GroupReward`) scores the
samples of a group together, once per group.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles.rewards.base import GroupReward, Reward, RewardOutput
from miles.types import Sample, SampleStatus

__all__ = [
    "NamedReward",
    "RewardScorer",
    "Scorer",
    "close_rewards",
    "reaches_scoring",
    "score_sample",
    "score_samples",
]

logger = logging.getLogger(__name__)

NamedReward = tuple[str, Reward[Any], float]
"""``(name, reward, weight)``: the name keys ``Sample.reward_parts``."""

Scorer = Callable[[Sequence[Sample]], Awaitable[None]]
"""Fills ``reward`` / ``reward_parts`` (or marks samples failed) for a list of samples."""

_SKIP = (SampleStatus.FAILED, SampleStatus.ABORTED, SampleStatus.PENDING)


def reaches_scoring(sample: Sample) -> bool:
    """Whether :func:`score_samples` scores ``sample`` (failed, aborted and pending samples are left as they are)."""
    return sample.status not in _SKIP


async def close_rewards(rewards: Sequence[NamedReward]) -> None:
    """Close every reward (HTTP clients ...)."""
    for _, reward, _ in rewards:
        await reward.close()


async def score_sample(sample: Sample, rewards: Sequence[NamedReward], timeout: float) -> None:
    """Score one sample with every function: ``reward = sum(weight * value)``, ``reward_parts[name] = value``
    (and ``reward_parts["name/part"]`` for named parts). The first failure marks the sample failed."""
    await _score_each(sample, rewards, timeout, 0.0, {})


async def _score_each(
    sample: Sample, rewards: Sequence[NamedReward], timeout: float, total: float, parts: dict[str, float]
) -> None:
    """:func:`score_sample` from ``total`` and ``parts`` (what the group functions gave the sample)."""
    for name, reward, weight in rewards:
        try:
            value = await asyncio.wait_for(reward.score(sample), timeout)
        except asyncio.TimeoutError:
            _fail(sample, parts, f"reward {name!r} timed out after {timeout:g}s")
            return
        except Exception as exc:
            _fail(sample, parts, f"reward {name!r} raised {type(exc).__name__}: {exc}")
            return
        number = _record(name, value, parts)
        if isinstance(number, str):
            _fail(sample, parts, number)
            return
        total += weight * number
    sample.reward = total
    sample.reward_parts = parts


def _record(name: str, value: Any, parts: dict[str, float]) -> float | str:
    """``value`` of function ``name`` into ``parts`` (its named parts too): its number, or why it is none."""
    if isinstance(value, RewardOutput):
        for part, v in value.parts.items():
            parts[f"{name}/{part}"] = float(v)
        value = value.value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        return f"reward {name!r} returned {value!r}, not a finite number"
    parts[name] = float(value)
    return float(value)


def _fail(sample: Sample, parts: dict[str, float], reason: str) -> None:
    logger.warning("sample %d/%d: %s", sample.group_id, sample.index, reason)
    sample.status = SampleStatus.FAILED
    sample.status_reason = reason
    sample.reward = None
    sample.reward_parts = parts


@dataclass
class _Tally:
    """What the group functions gave one sample so far: the weighted sum, the parts, or why it failed."""

    total: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    failure: str | None = None


async def _score_group(group: Sequence[Sample], rewards: Sequence[NamedReward], timeout: float) -> list[_Tally]:
    """Every group function on ``group`` (one call each, in order): each sample's tally. A call that raises,
    times out or answers the wrong number of results fails every sample; an exception in place of one result,
    or a value that is not a finite number, fails that sample."""
    tallies = [_Tally() for _ in group]
    for name, reward, weight in rewards:
        assert isinstance(reward, GroupReward)
        size = f"a group of {len(group)} sample{'s' if len(group) != 1 else ''}"
        results: Sequence[Any] = []
        failure: str | None = None
        try:
            results = await asyncio.wait_for(reward.score_group(group), timeout)
        except asyncio.TimeoutError:
            failure = f"reward {name!r} timed out after {timeout:g}s scoring {size}"
        except Exception as exc:
            failure = f"reward {name!r} raised {type(exc).__name__}: {exc} (scoring {size})"
        else:
            if len(results) != len(group):
                failure = f"reward {name!r} returned {len(results)} results for {size}"
        for i, tally in enumerate(tallies):
            if tally.failure is not None:
                continue
            if failure is not None:
                tally.failure = failure
            elif isinstance(results[i], Exception):
                tally.failure = f"reward {name!r} raised {type(results[i]).__name__}: {results[i]}"
            else:
                number = _record(name, results[i], tally.parts)
                if isinstance(number, str):
                    tally.failure = number
                else:
                    tally.total += weight * number
    return tallies


async def score_samples(
    samples: Sequence[Sample],
    rewards: Sequence[NamedReward],
    timeout: float,
    max_concurrency: int = 64,
    *,
    semaphore: asyncio.Semaphore | None = None,
) -> None:
    """Score ``samples`` in place, at most ``max_concurrency`` calls at once (or as many as ``semaphore``
    admits, shared with other calls); each function call is bounded by ``timeout`` seconds. Samples
    already failed, aborted or pending are left as they are.

    A :class:`~miles.rewards.base.GroupReward` scores the samples of each group (``group_id``) together,
    once per group, before the per-sample functions: every sample of the group that reached scoring goes to
    every group function, and a sample one of them fails is not scored further."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    bound = semaphore if semaphore is not None else asyncio.Semaphore(max_concurrency)
    todo = [s for s in samples if reaches_scoring(s)]
    grouped = [r for r in rewards if isinstance(r[1], GroupReward)]
    each = [r for r in rewards if not isinstance(r[1], GroupReward)]

    async def one(sample: Sample, tally: _Tally) -> None:
        if tally.failure is not None:
            _fail(sample, tally.parts, tally.failure)
            return
        async with bound:
            await _score_each(sample, each, timeout, tally.total, tally.parts)

    async def group(members: list[Sample]) -> None:
        async with bound:
            tallies = await _score_group(members, grouped, timeout)
        await asyncio.gather(*(one(s, t) for s, t in zip(members, tallies, strict=True)))

    if not grouped:
        await asyncio.gather(*(one(s, _Tally()) for s in todo))
        return
    groups: dict[int, list[Sample]] = {}
    for s in todo:
        groups.setdefault(s.group_id, []).append(s)
    await asyncio.gather(*(group(members) for members in groups.values()))


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
