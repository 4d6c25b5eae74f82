"""``score_samples``: weighted combination, named parts, timeouts and exceptions marking samples failed,
the concurrency bound, and building the functions from ``reward.functions``."""

from __future__ import annotations

import asyncio

import pytest

from miles.plugins.manager import PluginManager
from miles.rewards.base import Reward
from miles.rewards.scoring import RewardScorer, close_rewards, score_samples
from miles.rewards.text import (
    LengthPenaltyReward,
    LengthPenaltySettings,
    MathReward,
    MathSettings,
    RegexReward,
    RegexSettings,
)
from miles.settings.model import RewardSettings
from miles.types import Sample, SampleStatus

RIGHT = "<|im_start|>assistant\n<think>\n12 + 7 = 19\n</think>\nSo 12 + 7 = \\boxed{19}.<|im_end|>"
WRONG = "<|im_start|>assistant\n12 + 7 = \\boxed{20}<|im_end|>"
UNFORMATTED = "<|im_start|>assistant\n12 + 7 is 19<|im_end|>"


def sample(response: str, i: int, n_tokens: int = 4, status: SampleStatus = SampleStatus.COMPLETED) -> Sample:
    return Sample(
        prompt_ids=[1],
        response_ids=[5] * n_tokens,
        rollout_logprobs=[-1.0] * n_tokens,
        loss_mask=[1] * n_tokens,
        status=status,
        response=response,
        label="19",
        index=i,
    )


class Explodes(Reward):
    """Raises on responses that mention 20."""

    name = "explodes"

    async def score(self, sample: Sample) -> float:
        if "20" in sample.response:
            raise ZeroDivisionError("division by zero in the grader")
        return 0.5


class Sleeps(Reward):
    """Sleeps for the number of seconds in ``sample.metadata['sleep']``; counts how many run at once."""

    name = "sleeps"

    def __init__(self) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self.running = 0
        self.peak = 0

    async def score(self, sample: Sample) -> float:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(sample.metadata.get("sleep", 0.05))
        finally:
            self.running -= 1
        return 1.0


class NotANumber(Reward):
    """Returns NaN."""

    name = "nan"

    async def score(self, sample: Sample) -> float:
        return float("nan")


def functions() -> list[tuple[str, Reward, float]]:
    return [
        ("math", MathReward(MathSettings()), 1.0),
        ("format", RegexReward(RegexSettings(pattern=r"<think>.+</think>")), 0.2),
        ("length", LengthPenaltyReward(LengthPenaltySettings(max_length=10, buffer_length=4)), 1.0),
    ]


def test_weighted_combination_with_parts() -> None:
    samples = [sample(RIGHT, 0), sample(WRONG, 1), sample(UNFORMATTED, 2, n_tokens=8)]
    asyncio.run(score_samples(samples, functions(), timeout=30.0, max_concurrency=4))
    # right, formatted, 4 tokens: 1 * 1 + 0.2 * 1 + 0 = 1.2
    assert samples[0].reward == pytest.approx(1.2)
    assert samples[0].reward_parts == {"math": 1.0, "math/has_answer": 1.0, "format": 1.0, "length": 0.0}
    # wrong, unformatted: 0
    assert samples[1].reward == 0.0
    assert samples[1].reward_parts == {"math": 0.0, "math/has_answer": 1.0, "format": 0.0, "length": 0.0}
    # no box, unformatted, 8 tokens (2 into the 4-token buffer: -0.5): -0.5
    assert samples[2].reward == pytest.approx(-0.5)
    assert samples[2].reward_parts == {"math": 0.0, "math/has_answer": 0.0, "format": 0.0, "length": -0.5}
    assert all(s.status == SampleStatus.COMPLETED for s in samples)


def test_an_exception_marks_only_that_sample_failed() -> None:
    samples = [sample(RIGHT, 0), sample(WRONG, 1)]
    asyncio.run(
        score_samples(
            samples,
            [("math", MathReward(MathSettings()), 1.0), ("grader", Explodes(None), 1.0)],  # type: ignore[arg-type]
            timeout=30.0,
        )
    )
    assert samples[0].status == SampleStatus.COMPLETED and samples[0].reward == 1.5
    assert samples[1].status == SampleStatus.FAILED
    assert samples[1].status_reason == "reward 'grader' raised ZeroDivisionError: division by zero in the grader"
    assert samples[1].reward is None
    assert samples[1].reward_parts == {"math": 0.0, "math/has_answer": 1.0}  # what was scored before the failure


def test_a_timeout_marks_only_that_sample_failed() -> None:
    sleeps = Sleeps()
    samples = [sample(RIGHT, i) for i in range(3)]
    samples[1].metadata["sleep"] = 30.0
    asyncio.run(score_samples(samples, [("slow", sleeps, 1.0)], timeout=0.5, max_concurrency=3))
    assert [s.status for s in samples] == [SampleStatus.COMPLETED, SampleStatus.FAILED, SampleStatus.COMPLETED]
    assert samples[1].status_reason == "reward 'slow' timed out after 0.5s"
    assert samples[0].reward == 1.0 and samples[2].reward == 1.0
    assert sleeps.running == 0  # the timed-out call was cancelled


def test_non_finite_rewards_fail_the_sample() -> None:
    s = sample(RIGHT, 0)
    asyncio.run(score_samples([s], [("nan", NotANumber(None), 1.0)], timeout=5.0))  # type: ignore[arg-type]
    assert s.status == SampleStatus.FAILED and "not a finite number" in s.status_reason


def test_concurrency_bound_and_skipped_statuses() -> None:
    sleeps = Sleeps()
    samples = [sample(RIGHT, i) for i in range(8)]
    samples[6].status = SampleStatus.ABORTED
    samples[7].status = SampleStatus.FAILED
    samples[7].status_reason = "engine died"
    asyncio.run(score_samples(samples, [("s", sleeps, 1.0)], timeout=30.0, max_concurrency=2))
    assert sleeps.peak == 2
    assert [s.reward for s in samples] == [1.0] * 6 + [None, None]
    assert samples[7].status_reason == "engine died"
    with pytest.raises(ValueError, match="max_concurrency"):
        asyncio.run(score_samples(samples, [("s", sleeps, 1.0)], timeout=1.0, max_concurrency=0))


def test_truncated_samples_are_scored() -> None:
    s = sample(RIGHT, 0, status=SampleStatus.TRUNCATED)
    asyncio.run(score_samples([s], [("math", MathReward(MathSettings()), 1.0)], timeout=30.0))
    assert s.reward == 1.0 and s.status == SampleStatus.TRUNCATED


def test_build_rewards_from_settings() -> None:
    from miles.components import ComponentKind
    from miles.compose import build_run
    from miles.settings.model import MilesSettings

    manager = PluginManager(entry_points=False, disabled=(), only=())
    settings = RewardSettings(
        functions=[
            "math",
            {"name": "regex", "pattern": "<think>", "weight": 0.1},
            {"name": "regex", "pattern": "boxed", "weight": 0.1},
            {"name": "length_penalty", "max_length": 10, "buffer_length": 4, "weight": 2.0},
        ]
    )
    run = build_run(MilesSettings(reward=settings), manager, kinds=[ComponentKind.REWARD])
    rewards = run.rewards()
    assert [(n, type(r).__name__, w) for n, r, w in rewards] == [
        ("math", "MathReward", 1.0),
        ("regex", "RegexReward", 0.1),
        ("regex_2", "RegexReward", 0.1),
        ("length_penalty", "LengthPenaltyReward", 2.0),
    ]
    s = sample(RIGHT, 0, n_tokens=8)
    asyncio.run(score_samples([s], rewards, timeout=settings.timeout, max_concurrency=settings.max_concurrency))
    asyncio.run(close_rewards(rewards))
    # 1 + 0.1 + 0.1 + 2 * (-0.5) = 0.2
    assert s.reward == pytest.approx(0.2)
    # the run's scorer: the same functions, with the settings' timeout and one shared concurrency bound
    scorer = run.scorer()
    assert isinstance(scorer, RewardScorer) and (scorer.timeout, scorer.max_concurrency) == (30.0, 64)
    again = sample(RIGHT, 0, n_tokens=8)
    asyncio.run(scorer([again]))
    asyncio.run(scorer.close())
    assert again.reward == pytest.approx(0.2) and again.reward_parts == s.reward_parts
    bad = RewardSettings(functions=[{"name": "regex", "patern": "x"}])
    with pytest.raises(Exception, match=r"reward\.functions\[0\]"):
        build_run(MilesSettings(reward=bad), manager, kinds=[ComponentKind.REWARD])
