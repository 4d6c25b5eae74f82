from __future__ import annotations

import math

import pytest

from miles.driver.evaluate import eval_metrics, pass_at_k
from miles.types import Sample, SampleGroup, SampleStatus


def test_pass_at_k_matches_the_combinatorial_definition() -> None:
    # 1 - C(n-c, k) / C(n, k)
    for n, c, k in [(8, 2, 1), (8, 2, 4), (5, 0, 3), (5, 5, 1), (10, 3, 10), (4, 1, 2)]:
        expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_eval_metrics_over_groups() -> None:
    def group(gid: int, rewards: list[float], failed: int | None = None) -> SampleGroup:
        samples = [Sample([1], [2], [-1.0], [1], reward=r, group_id=gid, index=i) for i, r in enumerate(rewards)]
        if failed is not None:
            samples[failed].status = SampleStatus.FAILED
        return SampleGroup(gid, samples)

    groups = [group(0, [1.0, 0.0, 0.0, 0.0]), group(1, [1.0, 1.0, 0.0, 0.0], failed=0)]
    metrics = eval_metrics(groups, ks=[1, 2, 8])
    assert metrics["eval/reward_mean"] == pytest.approx(3 / 8)
    # group 0: c=1 of 4; group 1: the failed sample does not pass -> c=1 of 4
    assert metrics["eval/pass@1"] == pytest.approx(0.25)
    assert metrics["eval/pass@2"] == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    assert "eval/pass@8" not in metrics  # k larger than the group
