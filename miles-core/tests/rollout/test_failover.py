"""Engine failover with two real engine processes: one SIGKILLed while requests are in flight.

(The restart and rejoin at a weight push run for real in
``tests/integration/test_train.py::test_an_engine_sigkilled_mid_rollout_is_failed_over_restarted_and_rejoins``.)"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch

from miles.rollout.failover import NoEngineLeftError
from miles.rollout.http_client import HttpEngineClient
from miles.rollout.protocol import GenerateOutput
from miles.testing.engine import EngineProcess
from miles.testing.failover import assert_same_answers, generate_keyed

pytestmark = pytest.mark.slow

KEYS = [f"group-{i}" for i in range(8)]


async def _generate_all(client: HttpEngineClient) -> list[GenerateOutput]:
    return await generate_keyed(client, KEYS)


def test_a_killed_engines_requests_are_resent_with_their_seeds(tmp_path: Path) -> None:
    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "qwen2", "qwen2")
    engines = [EngineProcess(model, log_path=tmp_path / f"engine{i}.log") for i in range(2)]

    async def run() -> None:
        async with HttpEngineClient([e.url for e in engines], max_retries=1, backoff=0.05) as client:
            reference = await _generate_all(client)  # both engines serve, each its keys
            owners = {key: client.route(key) for key in KEYS}
            victim = engines[1]
            lost = [k for k in KEYS if owners[k] == victim.url]
            assert lost and len(lost) < len(KEYS), owners

            # the same requests again; SIGKILL engine 1 while its share is in flight
            task = asyncio.ensure_future(_generate_all(client))
            while client.outstanding[victim.url] < len(lost):
                await asyncio.sleep(0.005)
            assert victim.proc is not None
            os.kill(victim.proc.pid, signal.SIGKILL)
            again = await task

            # every request answered once, with what a healthy engine produced (same seed, same weights)
            assert_same_answers(again, reference, served_by=engines[0].url)
            assert list(client.urls) == [engines[0].url]
            metrics = client.failover_metrics()
            assert metrics == {
                "rollout/engine_failures": 1.0,
                "rollout/requests_retried": float(len(lost)),
                "rollout/engines_serving": 1.0,
            }
            assert f"{victim.url}/generate" in client.health_state.down[victim.url]

            # control calls skip the dead engine
            infos = await client.model_info()
            assert len(infos) == 1

            # every engine dead: generation stops with a clear error, it does not hang
            assert engines[0].proc is not None
            os.kill(engines[0].proc.pid, signal.SIGKILL)
            engines[0].proc.wait()
            with pytest.raises(NoEngineLeftError, match="no engine is left"):
                await _generate_all(client)

    try:
        for engine in engines:
            engine.start(wait=False)
        for engine in engines:
            engine.wait_ready()
        asyncio.run(run())
    finally:
        for engine in engines:
            engine.stop()
