"""The HTTP engine client against two real local engines: session-affine routing (consistent hashing),
least-outstanding routing, fleet-wide admin calls, retries while an engine starts, an engine restarted at its
URL told apart, waiting for a restart when no engine is left, errors."""

from __future__ import annotations

import asyncio
import errno
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles.errors import EngineError
from miles.net import free_port
from miles.rollout.http_client import EngineHTTPError, HttpEngineClient
from miles.rollout.protocol import SamplingParams
from miles.testing.engine import EngineProcess


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("client-model") / "qwen2", "qwen2")


@pytest.fixture(scope="module")
def engines(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    logs = tmp_path_factory.mktemp("client-logs")
    procs = [EngineProcess(model, log_path=logs / f"engine{i}.log") for i in range(2)]
    try:
        for p in procs:
            p.start(wait=False)
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


def test_session_affinity_and_prefix_reuse(engines: list[EngineProcess]) -> None:
    async def run() -> None:
        async with HttpEngineClient([e.url for e in engines]) as client:
            await client.flush_cache()
            owner: dict[str, str] = {}
            for turn in range(3):
                for s in range(12):
                    key = f"session-{s}"
                    prompt = [10 + s] * 8 + list(range(1, 2 + turn))
                    (out,) = await client.generate(prompt, SamplingParams(max_new_tokens=2), routing_key=key)
                    url = out.meta_info["engine_url"]
                    assert owner.setdefault(key, url) == url
                    if turn:  # the previous turn's prompt is a cached prefix on the same engine
                        assert out.cached_tokens >= 8
            assert set(owner.values()) == {e.url for e in engines}  # keys spread over both engines
            # a group: n samples of one prompt on one engine, all but the first hit the prompt
            outs = await client.generate([7] * 20, SamplingParams(max_new_tokens=3, n=4), routing_key="group-1")
            assert len(outs) == 4 and [o.cached_tokens for o in outs] == [0, 19, 19, 19]
            assert all(o.meta_info["engine_url"] == outs[0].meta_info["engine_url"] for o in outs)
            assert all(len(o.output_logprobs) == len(o.output_ids) for o in outs)

    asyncio.run(run())


def test_ring_moves_only_the_keys_of_a_removed_engine() -> None:
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    full, reduced = HttpEngineClient(urls), HttpEngineClient(urls[:3])
    keys = [f"k{i}" for i in range(400)]
    moved = [k for k in keys if full.route(k) != reduced.route(k)]
    assert all(full.route(k) == urls[3] for k in moved)
    assert 40 < len(moved) < 200
    assert set(Counter(full.route(k) for k in keys)) == set(urls)
    asyncio.run(full.close())
    asyncio.run(reduced.close())


def test_least_outstanding_spreads_unkeyed_requests(engines: list[EngineProcess]) -> None:
    async def run() -> Counter[str]:
        async with HttpEngineClient([e.url for e in engines]) as client:
            params = SamplingParams(max_new_tokens=40, ignore_eos=True)
            outs = await asyncio.gather(*(client.generate([1, 2, 3 + i], params) for i in range(8)))
            assert all(o[0].completion_tokens == 40 for o in outs)
            assert client.outstanding == {e.url: 0 for e in engines}
            return Counter(o[0].meta_info["engine_url"] for o in outs)

    assert sorted(asyncio.run(run()).values()) == [4, 4]


def test_admin_calls_reach_every_engine(engines: list[EngineProcess], model: Path) -> None:
    async def run() -> None:
        async with HttpEngineClient([e.url for e in engines]) as client:
            assert await client.health() == [True, True]
            await client.update_weights_from_disk(str(model), "v5")
            assert [i["weight_version"] for i in await client.model_info()] == ["v5", "v5"]
            await client.update_weight_version("v6")
            assert [i["weight_version"] for i in await client.model_info()] == ["v6", "v6"]
            await client.pause_generation("retract")
            task = asyncio.create_task(client.generate([1, 2], SamplingParams(max_new_tokens=2)))
            await asyncio.sleep(0.2)
            assert not task.done()  # held while paused
            await client.continue_generation()
            (out,) = await task
            assert out.finish_reason.type in ("length", "stop") and out.weight_version == "v6"
            # abort by rid goes to the engine that holds it
            long = asyncio.create_task(
                client.generate([5, 6], SamplingParams(max_new_tokens=900, ignore_eos=True), rid="r-long")
            )
            while client.outstanding[engines[0].url] + client.outstanding[engines[1].url] == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            await client.abort("r-long")
            (aborted,) = await long
            assert aborted.finish_reason.type == "abort"

    asyncio.run(run())


def test_http_errors_are_not_retried_and_carry_the_message(engines: list[EngineProcess]) -> None:
    async def run() -> None:
        async with HttpEngineClient([engines[0].url], max_retries=5) as client:
            with pytest.raises(EngineHTTPError, match="out of the vocabulary") as info:
                await client.generate([10**7], SamplingParams(max_new_tokens=2))
            assert info.value.status == 400
            with pytest.raises(EngineError, match="success|model_path"):
                await client.call(engines[0].url, "/update_weights_from_disk", {})

    asyncio.run(run())


def test_retries_until_a_starting_engine_answers_and_tells_its_restart_apart(model: Path, tmp_path: Path) -> None:
    """The client retries until a starting engine answers. Then the engine is stopped and started again at
    the same port between two probes, with no request failing on it meanwhile: ``check_engines`` tells the
    new process by its ``/health`` (it names another instance), counts the death, and the engine rejoins (it
    takes the next weight push) instead of serving the weights it loaded at start."""
    port = free_port()
    engine = EngineProcess(model, port=port, log_path=tmp_path / "late.log")

    async def run() -> None:
        async with HttpEngineClient([engine.url], max_retries=200, backoff=0.1, max_backoff=0.5) as client:
            engine.start(wait=False)  # the client's first attempts are refused
            (out,) = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=3, ignore_eos=True))
            assert out.completion_tokens == 3
            assert await client.check_engines() == [] and client.serving() == [engine.url]
            engine.stop()
            engine.start()  # the same URL, another process
            assert await client.check_engines() == [engine.url]
            assert client.serving() == [] and client.rejoining() == [engine.url]
            assert client.failover_metrics()["rollout/engine_failures"] == 1.0
            client.weights_reached("1")
            assert await client.check_engines() == [] and client.serving() == [engine.url]

    try:
        asyncio.run(run())
    finally:
        engine.stop()


def test_an_engine_that_names_no_process_is_told_restarted_by_its_launch_weight_version(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's ``/health`` names no process. The client is made blind to the local engine's header, as it
    is to SGLang's: once a push is verified, an engine that answers with its launch weight version (``0``)
    is a new process at the URL (it rejoins and takes the next push); an engine on another pushed version
    (a push that failed midway) is not."""
    from miles.rollout import http_client

    monkeypatch.setattr(http_client, "INSTANCE_HEADER", "x-not-sent-by-the-engine")
    port = free_port()
    engine = EngineProcess(model, port=port, log_path=tmp_path / "engine.log")

    async def run() -> None:
        async with HttpEngineClient([engine.url], max_retries=50, backoff=0.1) as client:
            assert await client.check_engines() == []  # before any push: nothing to compare
            await client.update_weight_version("3")
            client.weights_reached("3")
            assert await client.check_engines() == [] and client.serving() == [engine.url]
            await client.update_weight_version("4")  # a push that stopped after setting its version
            assert await client.check_engines() == [] and client.serving() == [engine.url]
            await client.update_weight_version("3")
            engine.stop()
            engine.start()  # the same URL, another process: version 0 again
            assert await client.check_engines() == [engine.url]
            assert client.serving() == [] and client.rejoining() == [engine.url]
            assert client.failover_metrics()["rollout/engine_failures"] == 1.0
            await client.update_weight_version("5")
            client.weights_reached("5")
            assert await client.check_engines() == [] and client.serving() == [engine.url]

    try:
        engine.start()
        asyncio.run(run())
    finally:
        engine.stop()


def test_unreachable_engine_fails_with_its_url_and_the_system_error() -> None:
    """Nothing listens: the error names the URL and the operating system's answer (refused), which httpx's
    own message ("All connection attempts failed") leaves out."""
    url = f"http://127.0.0.1:{free_port()}"

    async def run() -> None:
        async with HttpEngineClient([url], max_retries=2, backoff=0.01) as client:
            with pytest.raises(EngineError, match=url.replace(".", r"\.")) as raised:
                await client.generate([1], SamplingParams(max_new_tokens=1))
            assert f"[Errno {errno.ECONNREFUSED}]" in str(raised.value), raised.value
            assert await client.health() == [False]

    asyncio.run(run())


def test_memory_release_leaves_an_engine_that_died(engines: list[EngineProcess]) -> None:
    """A colocated run releases the engines' memory after each rollout: an engine that died meanwhile (its port
    closed) is marked down and left, not an error that stops the run (the next push takes its restart back);
    the live engine still releases and resumes. With every engine dead there is nothing to release: no error."""
    dead = f"http://127.0.0.1:{free_port()}"

    async def run() -> None:
        async with HttpEngineClient([engines[0].url, dead], max_retries=1, backoff=0.01) as client:
            await client.release_memory()
            assert list(client.urls) == [engines[0].url] and dead in client.health_state.down
            await client.resume_memory()
            await client.continue_generation()  # (as the training loop does after the push)
            (out,) = await client.generate([1, 2], SamplingParams(max_new_tokens=2))
            assert out.finish_reason.type in ("length", "stop")
        async with HttpEngineClient([dead], max_retries=1, backoff=0.01) as client:
            await client.release_memory()
            await client.resume_memory()
            assert not client.urls

    asyncio.run(run())


def test_with_no_engine_left_generation_waits_only_while_a_restart_may_come() -> None:
    """The engine's port is closed (a dead engine). Without ``wait_for_restarts`` the run's last engine lost
    raises at once; with a restart left the request waits for an engine to serve (also while the restarted
    engine rejoins, before a push has reached it), and gives up (raising, never hanging) at the timeout; once
    the engine has died more often than it may be restarted, at once."""
    from miles.rollout.failover import NoEngineLeftError

    url = f"http://127.0.0.1:{free_port()}"

    async def run() -> None:
        async with HttpEngineClient([url], max_retries=0, backoff=0.01) as client:
            with pytest.raises(NoEngineLeftError):
                await client.generate([1], SamplingParams(max_new_tokens=1))  # marked down, nothing to wait for
            client.wait_for_restarts(restarts=1, timeout=1.5)
            assert client.health_state.may_return() == [url]
            start = asyncio.get_running_loop().time()
            waiting = asyncio.ensure_future(client.generate([1], SamplingParams(max_new_tokens=1)))
            await asyncio.sleep(0.5)
            client.health_state.back_up(url)  # restarted: rejoining, it serves after the next push
            await asyncio.sleep(0.5)
            assert not waiting.done()  # still waiting: the engine may serve again
            with pytest.raises(NoEngineLeftError):
                await waiting  # no push reached it: the wait ends at the timeout
            assert 1.5 <= asyncio.get_running_loop().time() - start < 6.0
            client.weights_reached("1")  # then it serves, and dies again: past its one restart
            assert client.serving() == [url]
            start = asyncio.get_running_loop().time()
            with pytest.raises(NoEngineLeftError):
                await client.generate([1], SamplingParams(max_new_tokens=1))
            assert client.health_state.deaths[url] == 2 and client.health_state.may_return() == []
            assert asyncio.get_running_loop().time() - start < 0.6

    asyncio.run(run())


def test_a_router_this_process_cannot_reach_is_an_error_naming_it_and_routed_requests_are_counted() -> None:
    """On another host, a router bound to its loopback cannot be reached: trainer rank 0 stops at start with
    an error naming ``rollout.router`` (it never routes around it in silence). One it reaches counts the
    requests it served (``rollout/routed_requests``)."""
    import httpx

    def engines_only(request: httpx.Request) -> httpx.Response:
        if request.url.host == "router":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={})

    async def unreachable() -> None:
        client = HttpEngineClient(["http://engine:1"], router_url="http://router:2")
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(engines_only))
        with pytest.raises(EngineError, match=r"rollout.router: trainer rank 0 \(on .*\) cannot reach the router"):
            await client.wait_until_healthy(0.5, interval=0.1)
        await client.close()

    asyncio.run(unreachable())

    def routed(request: httpx.Request) -> httpx.Response:
        body = {"output_ids": [1], "meta_info": {"output_token_logprobs": [[-0.5, 1, None]], "finish_reason": None}}
        return httpx.Response(200, json=body, headers={"x-smg-routed-worker-id": "http://engine:1"})

    async def reachable() -> dict[str, float]:
        client = HttpEngineClient(["http://engine:1"], router_url="http://router:2")
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(routed))
        await client.wait_until_healthy(5)
        for key in ("a", "b", "c"):
            (out,) = await client.generate([1, 2], SamplingParams(max_new_tokens=1), routing_key=key)
            assert out.meta_info["engine_url"] == "http://engine:1"
        metrics = client.failover_metrics()
        await client.close()
        return metrics

    assert asyncio.run(reachable())["rollout/routed_requests"] == 3.0


class ClosingServer:
    """A real HTTP server on a socket that closes its first ``closes`` connections as soon as a request arrives
    on them, without an answer (as uvicorn closes a kept-alive connection idle for 5 s just as the client
    reuses it), and answers ``200`` on the others."""

    def __init__(self, closes: int) -> None:
        import socket
        import threading

        self.closes = closes
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.connections += 1
                conn.recv(65536)
                if self.connections > self.closes:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")

    def close(self) -> None:
        self.sock.close()


def test_a_connection_closed_under_a_health_probe_is_no_death() -> None:
    """The probe is sent again on a new connection: an engine whose connection closed under the first (or the
    second) is up; one that closes every connection does not answer."""
    from miles.rollout.http_client import HEALTH_ATTEMPTS

    async def scenario() -> None:
        flaky, dead = ClosingServer(closes=HEALTH_ATTEMPTS - 1), ClosingServer(closes=1000)
        try:
            async with HttpEngineClient([flaky.url, dead.url]) as client:
                assert await client.health() == [True, False]
                assert flaky.connections == HEALTH_ATTEMPTS and dead.connections == HEALTH_ATTEMPTS
                await client.check_engines()
                assert flaky.url not in client.health_state.down and dead.url in client.health_state.down
        finally:
            flaky.close()
            dead.close()

    asyncio.run(scenario())
