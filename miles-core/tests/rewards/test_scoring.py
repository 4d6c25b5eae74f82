"""``score_samples``: weighted combination, named parts, timeouts and exceptions marking samples failed,
the concurrency bound, building the functions from ``reward.functions``, and group rewards (a group's samples
scored together, once per group, next to per-sample functions)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from miles.components import ComponentSettings
from miles.plugins.manager import PluginManager
from miles.rewards.base import GroupReward, Reward, RewardOutput
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
from miles.testing import check_reward
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


class ShortestInGroup(GroupReward):
    """1 for the samples of the group with the shortest response (ties share it), else 0; the group's size is a
    named part. Records each call's group and indexes; a response ``boom`` makes the call raise, a response
    ``bad`` gets an exception in place of its result, a response ``nan`` a NaN."""

    name = "shortest_in_group"

    def __init__(self, settings: ComponentSettings | None = None, *, delay: float = 0.0) -> None:
        super().__init__(settings or ComponentSettings())
        self.calls: list[tuple[int, list[int]]] = []
        self.delay = delay

    async def score_group(self, samples: Sequence[Sample]) -> list[float | RewardOutput | Exception]:
        self.calls.append((samples[0].group_id, [s.index for s in samples]))
        await asyncio.sleep(self.delay)
        if any(s.response == "boom" for s in samples):
            raise RuntimeError("the group's judge is down")
        shortest = min(len(s.response) for s in samples)
        out: list[float | RewardOutput | Exception] = []
        for s in samples:
            if s.response == "bad":
                out.append(ValueError("cannot compare this one"))
            else:
                value = float("nan") if s.response == "nan" else float(len(s.response) == shortest)
                out.append(RewardOutput(value, {"group_size": float(len(samples))}))
        return out


class OneResultOnly(GroupReward):
    """Answers one result whatever the group's size."""

    name = "one_result"

    async def score_group(self, samples: Sequence[Sample]) -> list[float | RewardOutput | Exception]:
        return [1.0]


def grouped(group_id: int, *responses: str) -> list[Sample]:
    out = [sample(r, i) for i, r in enumerate(responses)]
    for s in out:
        s.group_id = group_id
    return out


def test_a_group_reward_scores_each_group_together_next_to_per_sample_functions() -> None:
    shortest = ShortestInGroup()
    first = grouped(0, "So 12 + 7 = \\boxed{19}.", "\\boxed{19}", "\\boxed{20}", "\\boxed{19} ...", "x")
    first[4].status, first[4].status_reason = SampleStatus.FAILED, "rollout failed: the engine died"
    first[3].status = SampleStatus.TRUNCATED
    second = grouped(1, "\\boxed{19}", "a long answer: \\boxed{19}")
    samples = [first[0], second[0], *first[1:], second[1]]  # groups interleaved, as a caller may pass them
    rewards = [("math", MathReward(MathSettings()), 1.0), ("shortest", shortest, 0.5)]
    asyncio.run(score_samples(samples, rewards, timeout=30.0))
    # one call per group, with the group's samples that reached scoring (the failed one is not among them)
    assert sorted(shortest.calls) == [(0, [0, 1, 2, 3]), (1, [0, 1])]
    assert [s.reward for s in first] == [1.0, 1.5, 0.5, 1.0, None]  # math + 0.5 * shortest of the group
    assert first[4].status == SampleStatus.FAILED and first[4].status_reason == "rollout failed: the engine died"
    assert first[3].status == SampleStatus.TRUNCATED  # a partial rollout is scored with its group
    assert first[1].reward_parts == {
        "shortest": 1.0,
        "shortest/group_size": 4.0,
        "math": 1.0,
        "math/has_answer": 1.0,
    }
    assert [s.reward for s in second] == [1.5, 1.0]  # \\boxed{19} is the shortest of its own group only
    assert [s.reward_parts["shortest"] for s in second] == [1.0, 0.0]


def test_group_reward_failures_fail_the_group_or_the_one_sample() -> None:
    shortest = ShortestInGroup()
    down = grouped(0, "\\boxed{19}", "boom")
    partly = grouped(1, "\\boxed{19}", "bad", "nan", "\\boxed{19}")
    wrong = grouped(2, "\\boxed{19}", "\\boxed{19}")
    rewards = [("shortest", shortest, 1.0), ("math", MathReward(MathSettings()), 1.0)]
    asyncio.run(score_samples(down + partly, rewards, timeout=30.0))
    # a call that raises fails every sample of its group, and no other group
    assert [s.status for s in down] == [SampleStatus.FAILED] * 2
    assert down[0].status_reason == (
        "reward 'shortest' raised RuntimeError: the group's judge is down (scoring a group of 2 samples)"
    )
    # an exception in place of one result, or a value that is not a number, fails that sample alone
    ok, failed = SampleStatus.COMPLETED, SampleStatus.FAILED
    assert [s.status for s in partly] == [ok, failed, failed, ok]
    assert partly[1].status_reason == "reward 'shortest' raised ValueError: cannot compare this one"
    assert partly[2].status_reason == "reward 'shortest' returned nan, not a finite number"
    # "bad" (3 characters) was the shortest of the group: 0 for the others, and the math function's 1
    assert [(s.reward_parts["shortest"], s.reward) for s in (partly[0], partly[3])] == [(0.0, 1.0)] * 2
    asyncio.run(score_samples(wrong, [("one", OneResultOnly(None), 1.0)], timeout=30.0))  # type: ignore[arg-type]
    assert {s.status_reason for s in wrong} == {"reward 'one' returned 1 results for a group of 2 samples"}
    slow = grouped(3, "\\boxed{19}", "\\boxed{20}")
    asyncio.run(score_samples(slow, [("shortest", ShortestInGroup(delay=30.0), 1.0)], timeout=0.3))
    assert {s.status_reason for s in slow} == {"reward 'shortest' timed out after 0.3s scoring a group of 2 samples"}


def test_the_run_scorer_and_the_conformance_kit_take_a_group_reward() -> None:
    shortest = ShortestInGroup()
    scorer = RewardScorer([("shortest", shortest, 1.0)], timeout=30.0, max_concurrency=1)
    group = grouped(7, "\\boxed{19}", "12 + 7 = \\boxed{19}")
    asyncio.run(scorer(group))  # the rollout manager's call: one group's samples
    assert [s.reward for s in group] == [1.0, 0.0] and shortest.calls == [(7, [0, 1])]
    # the kit scores each group of its samples with one score_group call; score() is a group of one
    assert check_reward(ShortestInGroup, samples=grouped(0, "ab", "a") + grouped(1, "abc")) == [0.0, 1.0, 1.0]
    assert asyncio.run(ShortestInGroup().score(sample("anything", 0))) == RewardOutput(1.0, {"group_size": 1.0})
    with pytest.raises(AssertionError, match=r"score_group\(group 0\) returned 1 results for 2 samples"):
        check_reward(OneResultOnly, samples=grouped(0, "a", "b"))
