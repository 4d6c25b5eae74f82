"""The async driver's parts against a real local engine process over HTTP: weight updates under each
pause mode (what happens to requests in flight and their per-span weight versions), and the rollout
producer with staleness admission control when the trainer's version moves past buffered groups."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.errors import SettingsError
from miles.rollout.buffer import StalenessBuffer
from miles.rollout.http_client import HttpEngineClient
from miles.rollout.manager import RolloutManager
from miles.rollout.producer import RolloutProducer, buffer_for
from miles.settings.model import MilesSettings, RolloutSettings
from miles.testing.engine import EngineProcess
from miles.testing.models import serve_tiny_model
from miles.types import Sample, SampleStatus, WeightSpan

pytestmark = pytest.mark.slow  # one engine process (~10-20 s to start on a loaded 2-core machine)

LENGTH = 400  # tokens per response: long enough that a pause always lands mid-generation


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with serve_tiny_model(tmp_path_factory.mktemp("async"), seed=0) as proc:
        yield proc


@pytest.fixture(scope="module")
def model(engine: EngineProcess) -> Path:
    return Path(engine.model_path)


async def length_scorer(samples: Any) -> None:
    """Reward = response length / 10 (a real, deterministic reward; the producer only needs a score)."""
    for s in samples:
        s.reward = s.response_length / 10


async def server_info(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        info: dict[str, Any] = (await http.get(url + "/server_info", timeout=10)).json()
        return info


async def until_all_decoding(url: str, n: int) -> None:
    """Wait until ``n`` requests are running and each has sampled at least one token."""
    while (await server_info(url))["num_running_reqs"] < n:
        await asyncio.sleep(0.002)
    start = (await server_info(url))["generated_tokens"]
    while (await server_info(url))["generated_tokens"] < start + 2 * n:  # two batched decode steps
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_weight_update_under_each_pause_mode(engine: EngineProcess, model: Path, mode: str) -> None:
    async def main() -> list[Sample]:
        async with HttpEngineClient([engine.url]) as client:
            await client.update_weight_version("0")
            settings = RolloutSettings(n_samples_per_prompt=2, max_new_tokens=LENGTH, min_new_tokens=LENGTH)
            manager = RolloutManager(client, settings, scorer=length_scorer, seed=0)
            from miles.data.base import Prompt

            pending = manager.new_group(Prompt("count", prompt_ids=[5, 6, 7, 8, 9]))
            task = asyncio.gather(*(manager.generate_sample(s) for s in pending))
            await until_all_decoding(engine.url, len(pending))
            await client.pause_generation(mode)  # type: ignore[arg-type]
            # the new version (loading the weights themselves is the engine tests' and the transports' job)
            await client.update_weight_version("1")
            info = (await client.model_info())[0]
            assert info["weight_version"] == "1"
            await client.continue_generation()
            return list(await task)

    samples = asyncio.run(main())
    assert len(samples) == 2
    for s in samples:
        s.validate()
        assert s.status == SampleStatus.TRUNCATED and s.response_length == LENGTH
        if mode == "abort":
            # the request was aborted; the manager regenerated it from scratch under the new weights
            assert s.weight_versions == [WeightSpan(0, LENGTH, 1)]
        else:
            # retract (KV recomputed) and in_place (KV kept) both resume the request: two spans
            assert len(s.weight_versions) == 2, s.weight_versions
            (old, new) = s.weight_versions
            assert old.start == 0 and old.version == 0 and new.version == 1
            assert 0 < old.end == new.start < LENGTH and new.end == LENGTH
            assert s.oldest_weight_version == 0


def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a in range(4) for b in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("policy", ["drop", "retry"])
def test_producer_never_hands_out_groups_past_the_staleness_bound(
    engine: EngineProcess, model: Path, tmp_path: Path, policy: str
) -> None:
    from transformers import AutoTokenizer

    from miles.components import ComponentKind
    from miles.compose import build_run
    from miles.plugins.manager import PluginManager

    run = build_run(
        MilesSettings(data={"path": str(data_file(tmp_path))}),
        PluginManager(entry_points=False),
        kinds=[ComponentKind.DATA_SOURCE],
    )
    data = run.data_source(AutoTokenizer.from_pretrained(model))

    async def main() -> tuple[list[Any], list[Any], StalenessBuffer, RolloutProducer]:
        async with HttpEngineClient([engine.url]) as client:
            await client.update_weight_version("0")
            settings = RolloutSettings(n_samples_per_prompt=2, max_new_tokens=6, min_new_tokens=6)
            manager = RolloutManager(client, settings, scorer=length_scorer, seed=0)
            buffer = StalenessBuffer(4, max_staleness=0, stale_policy=policy)  # type: ignore[arg-type]
            producer = RolloutProducer(manager, data, buffer, max_filtered=8)
            task = asyncio.create_task(producer.run())
            first = await buffer.get(2)
            while not buffer.ready:  # a group generated under version 0 waits in the buffer
                await asyncio.sleep(0.01)
            waiting = [g.group_id for g in buffer.ready]
            # the trainer pushed version 2: the engine serves it and the buffer knows it
            await client.update_weight_version("2")
            buffer.set_version(2)
            second = await buffer.get(2)
            if policy == "retry":  # the stale groups come back, regenerated under version 2, same ids

                async def back() -> None:
                    while not set(waiting) <= {g.group_id for g in [*second, *buffer.ready]}:
                        await asyncio.sleep(0.01)

                await asyncio.wait_for(back(), timeout=120)
                second += [g for g in buffer.ready if g.group_id in waiting]
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.abort()
            return first, second, buffer, producer

    first, second, buffer, producer = asyncio.run(main())
    assert all(s.oldest_weight_version == 0 for g in first for s in g.samples)
    assert all(s.oldest_weight_version == 2 for g in second for s in g.samples)  # never a stale one
    assert all(s.response_length == 6 and s.reward == 0.6 for g in second for s in g.samples)
    m = buffer.metrics()
    if policy == "drop":
        assert buffer.dropped >= 1 and buffer.retried == 0
    else:
        assert buffer.retried >= 1 and buffer.dropped == 0
    assert m["async/staleness_0"] == 8.0 and m["async/admitted_groups"] >= 4
    assert producer.inflight == {} and buffer.reserved == 0


def test_settings_are_checked_by_name() -> None:
    base = {"rollout_batch_size": 4, "n_samples_per_prompt": 2}
    with pytest.raises(SettingsError, match="rollout.buffer_groups"):
        buffer_for(RolloutSettings(mode="fully_async", buffer_groups=2, **base), num_rollouts=3)
    with pytest.raises(SettingsError, match="rollout.max_staleness"):
        buffer_for(RolloutSettings(mode="one_step_off", max_staleness=0, **base), num_rollouts=3)
    one = buffer_for(RolloutSettings(mode="one_step_off", max_staleness=3, **base), num_rollouts=3)
    assert (one.capacity, one.max_staleness, one.batch_groups, one.total_groups) == (4, 1, 4, 12)
    full = buffer_for(
        MilesSettings(
            rollout={"mode": "fully_async", "buffer_groups": 12, "max_staleness": 2, "stale_policy": "retry", **base}
        ).rollout,
        num_rollouts=5,
    )
    assert (full.capacity, full.max_staleness, full.stale_policy, full.total_groups) == (12, 2, "retry", 20)


def test_sync_rollout_and_producer_share_the_drop_budget(engine: EngineProcess, model: Path, tmp_path: Path) -> None:
    """One admission rule for both modes: an uninformative group is dropped until ``max_rounds x
    rollout_batch_size`` were dropped in a row, then kept anyway."""
    from transformers import AutoTokenizer

    from miles.algorithms.builtin import DAPO
    from miles.algorithms.settings import DAPOSettings
    from miles.components import ComponentKind
    from miles.compose import build_run
    from miles.plugins.manager import PluginManager

    run = build_run(
        MilesSettings(data={"path": str(data_file(tmp_path))}),
        PluginManager(entry_points=False),
        kinds=[ComponentKind.DATA_SOURCE],
    )
    data = run.data_source(AutoTokenizer.from_pretrained(model))
    dapo = DAPO(DAPOSettings())  # dynamic sampling: groups whose rewards are all equal carry no signal

    async def main() -> tuple[Any, Any]:
        async with HttpEngineClient([engine.url]) as client:
            # fixed lengths: every reward (length / 10) is equal, so every group is uninformative
            settings = RolloutSettings(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=3, min_new_tokens=3)
            manager = RolloutManager(client, settings, scorer=length_scorer, algorithm=dapo, seed=0, max_rounds=1)
            assert manager.budget.limit == 2
            result = await manager.rollout(data)
            buffered = RolloutManager(client, settings, scorer=length_scorer, algorithm=dapo, seed=0, max_rounds=1)
            buffer = StalenessBuffer(2, max_staleness=0)
            producer = RolloutProducer(buffered, data, buffer)
            task = asyncio.create_task(producer.run())
            got = await buffer.get(1)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.abort()
            return result, (got, producer)

    result, (got, producer) = asyncio.run(main())
    # sync: rounds of the missing groups, admitted in order: drop, drop, keep anyway, drop, drop, keep anyway
    assert len(result.groups) == 2
    assert result.metrics["rollout/groups_generated"] == 6.0 and result.metrics["rollout/groups_dropped"] == 4.0
    assert all(s.reward == 0.3 for g in result.groups for s in g.samples)
    # async: the same rule as groups finish: the third uninformative group in a row is kept
    assert len(got) == 1 and producer.budget is not None
