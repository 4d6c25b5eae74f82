"""The ``remote`` reward against a real HTTP server on loopback: parsing, retries, timeouts, errors."""

from __future__ import annotations

import asyncio

import pytest

from miles.rewards.base import RewardOutput
from miles.rewards.remote import RemoteReward, RemoteRewardError, RemoteRewardSettings
from miles.rewards.scoring import score_samples
from miles.types import Sample, SampleStatus

from .conftest import RewardServer


def sample(response: str, i: int = 0) -> Sample:
    return Sample(
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        rollout_logprobs=[-1.0, -1.0],
        loss_mask=[1, 1],
        status=SampleStatus.COMPLETED,
        prompt="Say hi",
        response=response,
        label={"answer": "hi"},
        index=i,
        metadata={"source": "unit"},
    )


def run_one(settings: RemoteRewardSettings, s: Sample) -> RewardOutput:
    async def go() -> RewardOutput:
        reward = RemoteReward(settings)
        try:
            return await reward.score(s)
        finally:
            await reward.close()

    return asyncio.run(go())


def test_scores_and_sends_the_sample(reward_server: RewardServer) -> None:
    settings = RemoteRewardSettings(
        url=f"{reward_server.url}/score", headers={"Authorization": "Bearer t0ken"}, send_token_ids=True
    )
    out = run_one(settings, sample("hello there"))
    assert out == RewardOutput(1.1, {"auth": 1.0})
    body = reward_server.bodies[-1]
    assert body == {
        "prompt": "Say hi",
        "response": "hello there",
        "label": {"answer": "hi"},
        "metadata": {"source": "unit"},
        "prompt_ids": [1, 2],
        "response_ids": [3, 4],
    }
    assert run_one(RemoteRewardSettings(url=f"{reward_server.url}/number"), sample("x")) == RewardOutput(0.25)


def test_retries_5xx_then_succeeds(reward_server: RewardServer) -> None:
    settings = RemoteRewardSettings(url=f"{reward_server.url}/flaky", max_retries=3, backoff=0.01)
    assert run_one(settings, sample("x")).value == 1.0
    assert reward_server.hits["/flaky"] == 3


def test_gives_up_after_the_retries(reward_server: RewardServer) -> None:
    settings = RemoteRewardSettings(url=f"{reward_server.url}/flaky", max_retries=1, backoff=0.01)
    with pytest.raises(RemoteRewardError, match="after 2 attempt.*HTTP 503"):
        run_one(settings, sample("x"))
    assert reward_server.hits["/flaky"] == 2


def test_client_errors_and_bad_bodies_fail_at_once(reward_server: RewardServer) -> None:
    for path, match in (("/bad_request", "HTTP 400"), ("/not_json", "not JSON"), ("/nan", "finite number")):
        with pytest.raises(RemoteRewardError, match=match):
            run_one(RemoteRewardSettings(url=f"{reward_server.url}{path}", max_retries=3, backoff=0.01), sample("x"))
        assert reward_server.hits[path] == 1


def test_request_timeout_is_retried_then_fails(reward_server: RewardServer) -> None:
    settings = RemoteRewardSettings(url=f"{reward_server.url}/slow", request_timeout=0.2, max_retries=1, backoff=0.01)
    with pytest.raises(RemoteRewardError, match="Timeout"):
        run_one(settings, sample("x"))
    assert reward_server.hits["/slow"] == 2


def test_connection_refused_is_an_error() -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RemoteRewardError, match="ConnectError"):
        run_one(RemoteRewardSettings(url=f"http://127.0.0.1:{port}/score", max_retries=1, backoff=0.01), sample("x"))


def test_through_score_samples_a_slow_server_fails_only_its_samples(reward_server: RewardServer) -> None:
    good = RemoteReward(RemoteRewardSettings(url=f"{reward_server.url}/score"))
    slow = RemoteReward(RemoteRewardSettings(url=f"{reward_server.url}/slow", max_retries=0))
    samples = [sample("abcd", i) for i in range(4)]

    async def go() -> None:
        await score_samples(samples[:3], [("rm", good, 2.0)], timeout=30.0, max_concurrency=2)
        await score_samples(samples[3:], [("rm", good, 1.0), ("slow_rm", slow, 1.0)], timeout=0.3, max_concurrency=2)
        await good.close()
        await slow.close()

    asyncio.run(go())
    for s in samples[:3]:
        assert s.status == SampleStatus.COMPLETED
        assert s.reward == pytest.approx(0.8)  # 2.0 * len("abcd") / 10
        assert s.reward_parts == {"rm": 0.4, "rm/auth": 0.0}
    assert samples[3].status == SampleStatus.FAILED
    assert samples[3].status_reason == "reward 'slow_rm' timed out after 0.3s"
    assert samples[3].reward is None
