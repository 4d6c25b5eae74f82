"""The staleness buffer: capacity and backpressure, the staleness window, admission control (drop and
retry), FIFO hand-over, metrics and the staleness histogram, checkpoint round trips, closing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

import pytest

from miles.rollout.buffer import BufferClosedError, StalenessBuffer, group_staleness, pending_group
from miles.types import Sample, SampleGroup, SampleStatus, WeightSpan


def group(gid: int, *versions: int | tuple[int, ...], n: int = 2) -> SampleGroup:
    """A scored group; each entry of ``versions`` is one sample's span versions (4 tokens per span)."""
    spec = list(versions) or [0] * n
    samples = []
    for i, v in enumerate(spec):
        vs = v if isinstance(v, tuple) else (v,)
        spans = [WeightSpan(4 * j, 4 * j + 4, x) for j, x in enumerate(vs)]
        length = 4 * len(vs)
        samples.append(
            Sample(
                prompt_ids=[1, 2, 3],
                response_ids=list(range(length)),
                rollout_logprobs=[-0.5] * length,
                loss_mask=[1] * length,
                reward=1.0,
                status=SampleStatus.COMPLETED,
                group_id=gid,
                index=i,
                prompt="p",
                label="7",
                weight_versions=spans,
                metadata={"cached_tokens": 2, "row": gid},
            )
        )
    return SampleGroup(gid, samples)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


async def settle() -> None:
    """Let every ready task run until it blocks (single-threaded event loop: deterministic)."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_capacity_counts_reserved_slots_and_backpressures_the_producer() -> None:
    async def main() -> None:
        buf = StalenessBuffer(3, max_staleness=0)
        for _ in range(2):
            await buf.reserve()
        assert await buf.put(group(0), reserved=True)
        assert (len(buf), buf.reserved, buf.free_slots) == (1, 1, 1)
        await buf.reserve()  # the last slot
        blocked = asyncio.create_task(buf.reserve())
        blocked_put = asyncio.create_task(buf.put(group(9)))  # an unreserved put waits for a slot too
        await settle()
        assert not blocked.done() and not blocked_put.done()
        assert await buf.get(1) == [group(0)]  # taking a group frees its slot: one waiter proceeds
        await settle()
        assert blocked.done() != blocked_put.done()
        buf.release()  # a filtered-out group gives its slot back: the other proceeds
        await settle()
        assert blocked.done() and blocked_put.done()
        assert buf.reserved + len(buf) == 3
        m = buf.metrics()
        assert m["async/producer_wait_seconds"] > 0.0 and m["async/buffer_fill"] == 1.0
        assert m["async/buffer_fill_fraction"] == pytest.approx(1 / 3)
        with pytest.raises(ValueError, match="capacity 3"):
            await buf.get(4)

    run(main())


def test_get_waits_for_a_full_batch_and_is_fifo() -> None:
    async def main() -> None:
        buf = StalenessBuffer(8, max_staleness=1)
        taker = asyncio.create_task(buf.get(3))
        for gid in (5, 3, 9):
            await settle()
            assert not taker.done()
            await buf.put(group(gid))
        await settle()
        assert [g.group_id for g in taker.result()] == [5, 3, 9]
        assert buf.consumed == 3 and len(buf) == 0
        assert buf.metrics()["async/trainer_wait_seconds"] > 0.0

    run(main())


def test_staleness_window_limits_how_far_the_producer_runs_ahead() -> None:
    async def main() -> None:
        # 2 groups per step, staleness 1: at version v the producer may have started 2 x (v + 2) groups
        buf = StalenessBuffer(100, max_staleness=1, batch_groups=2, total_groups=10)
        assert buf.free_slots == 4
        for gid in range(4):
            await buf.reserve()
            await buf.put(group(gid, 0, 0), reserved=True)
        assert buf.free_slots == 0
        await buf.get(2)
        assert buf.free_slots == 0  # consumed groups still count until the version moves
        buf.set_version(1)
        assert buf.free_slots == 2
        await buf.get(2)
        buf.set_version(2)
        assert buf.free_slots == 4
        buf.set_version(5)
        assert buf.free_slots == 6  # total_groups caps it: 10 - 4 consumed
        # with max_staleness 0 nothing is generated ahead of the trainer: the synchronous schedule
        sync = StalenessBuffer(100, max_staleness=0, batch_groups=2)
        assert sync.free_slots == 2
        for gid in range(2):
            await sync.reserve()
            await sync.put(group(gid), reserved=True)
        await sync.get(2)
        assert sync.free_slots == 0
        sync.set_version(1)
        assert sync.free_slots == 2

    run(main())


def test_window_follows_the_engines_version_while_a_push_is_committed() -> None:
    async def main() -> None:
        # the trainer staged version 1 but the engines still serve 0: a group started now would be
        # generated by version 0, so the window stays where version 0 puts it until the commit lands
        buf = StalenessBuffer(100, max_staleness=1, batch_groups=2)
        for gid in range(4):
            await buf.reserve()
            await buf.put(group(gid, 0, 0), reserved=True)
        await buf.get(2)
        buf.set_version(1, engines=0)
        assert (buf.version, buf.engine_version, buf.free_slots) == (1, 0, 0)
        assert len(buf) == 2  # admission still measures staleness against the trainer: version 0 is 1 behind
        buf.set_engine_version(1)
        assert (buf.engine_version, buf.free_slots) == (1, 2)
        buf.set_engine_version(7)  # never ahead of the trainer
        assert buf.engine_version == 1
        await buf.get(2)
        buf.set_version(2)  # an in-line push: the engines serve what the trainer holds
        assert (buf.engine_version, buf.free_slots) == (2, 4)

    run(main())


def test_admission_drops_stale_groups_on_arrival_and_while_waiting() -> None:
    async def main() -> None:
        buf = StalenessBuffer(8, max_staleness=1, stale_policy="drop")
        buf.set_version(3)
        assert group_staleness(group(0, 1, 3), 3) == 2
        assert not await buf.put(group(0, 1, 3))  # one sample two versions behind: the group goes
        assert await buf.put(group(1, 2, 3))
        assert await buf.put(group(2, (2, 3), 3))  # a partial rollout: its oldest span counts
        assert await buf.put(group(3, 3, 3))
        assert [g.group_id for g in buf.ready] == [1, 2, 3]
        buf.set_version(4)  # groups 1 and 2 are now two versions behind: never handed out
        taker = asyncio.create_task(buf.get(2))
        await settle()
        assert not taker.done() and [g.group_id for g in buf.ready] == [3]
        await buf.put(group(4, 4, (3, 4)))
        out = await taker
        assert [g.group_id for g in out] == [3, 4]
        for g in out:
            for s in g.samples:
                assert 4 - s.oldest_weight_version <= 1  # type: ignore[operator]
        assert buf.take_retry() is None
        m = buf.metrics()
        assert m["async/stale_dropped_groups"] == 3.0 and buf.dropped == 3
        assert m["async/admitted_groups"] == 4.0
        # histogram of the samples handed out: group 3 (v3, v3) and group 4 (v4, v3..v4) at version 4
        assert (m["async/staleness_0"], m["async/staleness_1"]) == (1.0, 3.0)
        assert m["async/staleness_mean"] == 0.75 and m["async/staleness_max"] == 1.0
        assert buf.metrics()["async/staleness_0"] == 0.0  # the window was reset
        assert buf.histogram == {0: 1, 1: 3}

    run(main())


def test_retry_policy_queues_stale_groups_as_fresh_prompts() -> None:
    async def main() -> None:
        buf = StalenessBuffer(8, max_staleness=0, stale_policy="retry")
        buf.set_version(2)
        assert not await buf.put(group(7, 1, 2))
        assert buf.retried == 1 and len(buf) == 0 and buf.free_slots == 8
        retry = buf.take_retry()
        assert retry is not None and retry.group_id == 7 and buf.take_retry() is None
        for i, s in enumerate(retry.samples):
            assert (s.group_id, s.index, s.prompt_ids, s.label, s.prompt) == (7, i, [1, 2, 3], "7", "p")
            assert s.response_ids == [] and s.weight_versions == [] and s.reward is None
            assert s.status == SampleStatus.PENDING and s.metadata == {"row": 7}
        assert buf.metrics()["async/stale_retried_groups"] == 1.0

    run(main())


def test_state_round_trips_through_json() -> None:
    async def main() -> None:
        buf = StalenessBuffer(8, max_staleness=1, stale_policy="retry", batch_groups=2)
        for gid in range(3):
            await buf.put(group(gid, 0, (0, 1)))
        await buf.get(2)
        buf.set_version(2)  # group 2 becomes stale: queued for retry
        await buf.reserve()
        await buf.put(group(3, 1, 2), reserved=True)
        state = json.loads(json.dumps(buf.state_dict()))
        restored = StalenessBuffer(8, max_staleness=1, stale_policy="retry", batch_groups=2)
        restored.load_state_dict(state, pending=[group(4, 2, 2)])
        assert [g.to_dict() for g in restored.ready] == [group(3, 1, 2).to_dict()]
        assert [g.group_id for g in restored.retry] == [2, 4]
        assert all(s.response_ids == [] for g in restored.retry for s in g.samples)
        assert (restored.version, restored.consumed, restored.retried) == (2, 2, 1)
        assert restored.histogram == buf.histogram == {0: 4}
        assert restored.free_slots == buf.free_slots == 5  # window (2 + 1 + 1) x 2 - 2 consumed - 1 ready

    run(main())


def test_close_wakes_waiters_with_the_cause() -> None:
    async def main() -> None:
        buf = StalenessBuffer(1, max_staleness=0)
        taker = asyncio.create_task(buf.get(1))
        await settle()
        buf.close(RuntimeError("reward server down"))
        with pytest.raises(BufferClosedError, match="reward server down"):
            await taker
        with pytest.raises(BufferClosedError):
            await buf.reserve()

    run(main())


def test_bad_arguments_name_the_parameter() -> None:
    with pytest.raises(ValueError, match="capacity"):
        StalenessBuffer(0, max_staleness=1)
    with pytest.raises(ValueError, match="stale_policy"):
        StalenessBuffer(1, max_staleness=1, stale_policy="keep")  # type: ignore[arg-type]
    assert pending_group(group(1)).samples[0].metadata == {"row": 1}


def test_drop_budget_keeps_one_group_after_the_limit() -> None:
    from miles.rollout.manager import DropBudget
    from miles.types import SampleGroup

    budget = DropBudget(2)
    group = SampleGroup(7, [])
    assert budget.admit(group, True)
    assert [budget.admit(group, False) for _ in range(3)] == [False, False, True]  # the third is kept anyway
    assert budget.in_row == 0 and budget.take_dropped() == 2 and budget.take_dropped() == 0
    assert [budget.admit(group, False), budget.admit(group, True), budget.admit(group, False)] == [False, True, False]
    assert budget.take_dropped() == 2
