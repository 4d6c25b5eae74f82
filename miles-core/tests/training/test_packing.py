"""Micro-batch planning by a token budget, shared by the trainer backends."""

from __future__ import annotations

import pytest

from miles.training.packing import agree_max, balanced_bins, first_fit_decreasing


def test_count_uses_first_fit_decreasing_and_isolates_long_sequences() -> None:
    assert len(first_fit_decreasing([10, 10, 10, 10], 20)) == 2
    assert len(first_fit_decreasing([15, 6, 5, 14], 20)) == 2
    assert len(first_fit_decreasing([50, 3], 20)) == 2  # the long one alone, over the budget
    assert len(first_fit_decreasing([], 20)) == 0


@pytest.mark.parametrize(
    ("lengths", "budget", "bins"),
    [([10, 10, 10, 10], 20, 2), ([9, 8, 7, 3, 2], 12, 3), ([5, 5], 40, 4), ([30, 1, 1, 1], 20, 2), ([7], 4, 3)],
)
def test_plan_keeps_every_sequence_once_within_budget(lengths: list[int], budget: int, bins: int) -> None:
    plan = balanced_bins(lengths, budget, bins)
    assert len(plan) == bins
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    for members in plan:
        assert members == sorted(members)
        assert len(members) <= 1 or sum(lengths[i] for i in members) <= budget


def test_plan_balances_tokens_over_more_bins_than_needed() -> None:
    plan = balanced_bins([8, 8, 8, 8], 32, 2)
    assert [sum(8 for _ in b) for b in plan] == [16, 16]


def test_plan_refuses_fewer_bins_than_the_budget_allows() -> None:
    with pytest.raises(ValueError, match="need 2 micro-batches"):
        balanced_bins([10, 10], 10, 1)


def test_first_fit_decreasing_sorts_each_bin_and_agree_max_is_at_least_one() -> None:
    import torch

    # 9 first, then 8 (no room beside 9), 4 beside 8, 3 beside 9
    assert first_fit_decreasing([3, 9, 4, 8], 12) == [[0, 1], [2, 3]]
    assert agree_max(0, torch.device("cpu")) == 1 and agree_max(3, torch.device("cpu")) == 3
