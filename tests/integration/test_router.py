"""Two local engines behind a real router (smg): a GRPO run trains end to end through it, and the engines'
own counters (``/server_info``) show every request of a group and every turn of a session on one engine,
while control calls reach both engines directly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.testing.runs import children_of_run, read_metrics, run_miles, write_run_config

pytestmark = pytest.mark.slow


ROUTER = """
[rollout.router]
name = "smg"
policy = "manual"
"""


def test_a_key_that_starts_with_a_dash_reaches_smg_whole() -> None:
    """A generated key starts with "-" once in 64 runs; as a separate argument after ``--api-key`` smg's
    argparse took it for a flag and smg exited ("expected one argument"), failing a multinode CI run."""
    from smg.cli import create_parser
    from smg.launch_router import parse_router_args

    from miles.auth import ServiceKeys
    from miles.rollout.router import smg_key_flags

    flags = smg_key_flags(ServiceKeys("-k3y", "--adm1n"))
    _, rest = create_parser().parse_known_args(["launch", "--worker-urls", "http://127.0.0.1:1", *flags])
    args = parse_router_args(rest)
    assert args.api_key == "-k3y"
    assert [(name, key, role) for name, _, key, role in args.control_plane_api_keys] == [("miles", "--adm1n", "admin")]


def test_grpo_through_smg_with_two_engines(tmp_path: Path, tiny_model: Path, prompts: Path) -> None:
    """``miles train`` with 2 engines behind smg: trains, broadcasts to both engines, verifies, and each
    group's samples share one engine's prefix cache (only a group's first sample computes its prompt)."""
    run_dir = tmp_path / "run"
    config = write_run_config(tmp_path, tiny_model, prompts, run_dir, ROUTER, ranks=1, rollouts=2)
    out = run_miles("train", str(config), "--set", "cluster.num_engines=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    launch = json.loads((run_dir / "fleet.json").read_text())
    assert len(launch["engine_urls"]) == 2 and launch["router_url"] not in launch["engine_urls"]
    assert (run_dir / "logs" / "router.log").exists()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["weight_sync/verified"] == 1.0
        assert row["weight_sync/verified_tensors"] > 0
        assert row["rollout/prefix_cache_hit_rate"] > 0.6
    for dump in sorted((run_dir / "samples").glob("rollout_*.jsonl")):
        groups: dict[int, list[dict[str, Any]]] = {}
        for line in dump.read_text().splitlines():
            sample = json.loads(line)
            groups.setdefault(sample["group_id"], []).append(sample["metadata"])
        assert len(groups) == 4
        for group_id, samples in groups.items():
            full_hits = sum(m["cached_tokens"] == m["prompt_tokens"] - 1 for m in samples)
            assert full_hits == len(samples) - 1, (dump.name, group_id, samples)
    assert children_of_run(run_dir) == []


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Any]:
    """Two local engines and smg, launched the way ``miles train`` does (``launch_fleet``)."""
    from miles.compose import build_run
    from miles.host.train import launch_fleet
    from miles.settings.model import MilesSettings

    settings = MilesSettings.model_validate(
        {
            "cluster": {"num_engines": 2},
            "train": {"model_path": str(tiny_model)},
            "rollout": {"router": {"name": "smg", "policy": "manual"}},
        }
    )
    run = build_run(settings)
    with run.launcher(run_dir=str(tmp_path_factory.mktemp("fleet"))) as launcher:
        yield launch_fleet(run, launcher)


def counters(urls: list[str]) -> list[int]:
    return [int(httpx.get(url + "/server_info", timeout=10).json()["generate_requests"]) for url in urls]


def test_groups_and_sessions_stay_on_one_engine(fleet: Any) -> None:
    from miles.rollout.protocol import SamplingParams

    urls = fleet.engine_urls
    params = SamplingParams(max_new_tokens=4, temperature=1.0)

    async def main() -> None:
        client = fleet.client()
        try:
            # 8 groups of 4 in flight at once, as the rollout manager sends them
            before = counters(urls)
            placed: dict[int, set[str]] = {}

            async def sample(group: int) -> None:
                prompt = [11, 12, 13, 14, 20 + group, 21, 22]
                out = await client.generate(prompt, params, routing_key=f"group-{group}")
                placed.setdefault(group, set()).add(out[0].meta_info["engine_url"])

            await asyncio.gather(*(sample(g) for g in range(8) for _ in range(4)))
            after = counters(urls)
            assert sum(after) - sum(before) == 32
            assert all(len(engines) == 1 for engines in placed.values()), placed
            per_engine = [sum(1 for e in placed.values() if url in e) * 4 for url in urls]
            assert [a - b for a, b in zip(after, before, strict=True)] == per_engine  # the engines' own count
            assert min(per_engine) > 0  # both engines got groups

            # one group at a time: its 4 requests raise exactly one engine's counter by 4
            for group in range(100, 104):
                before = counters(urls)
                await asyncio.gather(*(sample(group) for _ in range(4)))
                delta = sorted(a - b for a, b in zip(counters(urls), before, strict=True))
                assert delta == [0, 4], (group, delta)

            # a 10-turn session: every turn on one engine, each turn's prompt cached up to the last turn's end
            before = counters(urls)
            history = [30, 31, 32, 33]
            for turn in range(10):
                out = (await client.generate(history, params, routing_key="session-abc"))[0]
                if turn:
                    assert out.cached_tokens >= len(history) - 3, (turn, out.cached_tokens, len(history))
                history = [*history, *out.output_ids, 40 + turn, 41]
            delta = sorted(a - b for a, b in zip(counters(urls), before, strict=True))
            assert delta == [0, 10], delta

            # control calls go to each engine directly, not through the router
            await client.flush_cache()
            infos = [httpx.get(url + "/server_info", timeout=10).json() for url in urls]
            assert [i["cache_tokens"] for i in infos] == [0, 0]
            versions = await client.model_info()
            assert len(versions) == 2
        finally:
            await client.close()

    asyncio.run(main())


def test_router_health_and_registration(fleet: Any) -> None:
    """smg registered exactly the two engines and reports them healthy."""
    workers = httpx.get(fleet.router_url + "/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(fleet.engine_urls)
    assert all(w["is_healthy"] for w in workers)
    ready = httpx.get(fleet.router_url + "/readiness", timeout=10).json()
    assert ready["healthy_workers"] == 2


def test_an_engine_sigkilled_behind_smg_loses_no_request(tmp_path: Path, tiny_model: Path) -> None:
    """Two engines behind a real smg (``manual`` policy) and the rollout's client: 8 keyed requests in flight,
    one engine SIGKILLed once it holds all of its share (paused in place, so none is answered before). smg re-sends them to the engine left, so every request is
    answered once, with the tokens the healthy fleet produced for it (same seeds, same weights); later
    requests of the dead engine's keys go to the engine left. Then smg itself is SIGKILLed with requests in
    flight: the client routes them, and every later request, to the engines itself, with the same tokens.
    With no engine left the client gets an error, not a hang."""
    import os
    import signal
    import subprocess
    import time

    from miles.net import free_port
    from miles.rollout.http_client import EngineError, HttpEngineClient
    from miles.rollout.router import smg_argv, wait_for_router
    from miles.settings.model import RouterSettings
    from miles.testing.engine import EngineProcess
    from miles.testing.failover import assert_same_answers, generate_keyed

    keys = [f"group-{i}" for i in range(8)]

    async def generate_all(client: HttpEngineClient) -> list[Any]:
        return await generate_keyed(client, keys)

    engines = [EngineProcess(tiny_model, log_path=tmp_path / f"engine{i}.log") for i in range(2)]
    router: subprocess.Popen[bytes] | None = None
    try:
        for engine in engines:
            engine.start(wait=False)
        for engine in engines:
            engine.wait_ready()
        urls = [engine.url for engine in engines]
        port = free_port("127.0.0.1")
        argv = smg_argv(
            RouterSettings(name="smg", policy="manual"),
            urls,
            host="127.0.0.1",
            port=port,
            prometheus_port=free_port("127.0.0.1"),
        )
        with (tmp_path / "router.log").open("wb") as log_file:
            router = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
        router_url = f"http://127.0.0.1:{port}"
        wait_for_router(router_url, urls, timeout=60)

        async def main() -> None:
            async with (
                HttpEngineClient(urls, router_url=router_url, max_retries=3, backoff=0.05) as client,
                httpx.AsyncClient(timeout=10) as probe,
            ):
                reference = await generate_all(client)
                owners = [o.meta_info["engine_url"] for o in reference]
                assert set(owners) == set(urls), owners  # both engines hold keys
                victim, survivor = engines[1], engines[0]

                # the victim holds its requests (paused in place) until every one it owns has arrived, then dies
                # with all of them in flight: killing it at its first running request let another finish
                # first under load (a flake: its answer came from the victim)
                paused = await probe.post(victim.url + "/pause_generation", json={"mode": "in_place"})
                assert paused.status_code == 200, paused.text
                task = asyncio.ensure_future(generate_all(client))
                mine = owners.count(victim.url)
                deadline = time.monotonic() + 60
                while True:
                    info = (await probe.get(victim.url + "/server_info")).json()
                    if info["num_running_reqs"] + info["num_waiting_reqs"] >= mine:
                        break
                    assert time.monotonic() < deadline and not task.done(), (
                        f"the victim never held its requests: {info}"
                    )
                    await asyncio.sleep(0.005)
                assert victim.proc is not None
                os.kill(victim.proc.pid, signal.SIGKILL)
                again = await task

                assert_same_answers(again, reference, served_by=survivor.url)
                survivor_info = (await probe.get(survivor.url + "/server_info")).json()
                # each request generated once on the survivor per round, plus the dead engine's share once more
                assert survivor_info["generate_requests"] == 8 + owners.count(survivor.url), survivor_info

                # the dead engine's keys stay served by the engine left
                later = await generate_all(client)
                assert [o.output_ids for o in later] == [o.output_ids for o in reference]

                # the router SIGKILLed with requests in flight: the client routes to the engines itself
                assert router is not None
                task = asyncio.ensure_future(generate_all(client))
                while (await probe.get(survivor.url + "/server_info")).json()["num_running_reqs"] == 0:
                    await asyncio.sleep(0.005)
                router.kill()
                router.wait()
                without_router = await task
                assert_same_answers(without_router, reference, served_by=survivor.url)
                assert client.router_url is None

                # no engine left: an error within the client's retries, not a hang
                assert survivor.proc is not None
                os.kill(survivor.proc.pid, signal.SIGKILL)
                survivor.proc.wait()
                started = time.monotonic()
                with pytest.raises(EngineError):
                    await generate_all(client)
                assert time.monotonic() - started < 60

        asyncio.run(main())
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=30)
        for engine in engines:
            engine.stop()
