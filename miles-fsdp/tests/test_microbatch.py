"""Micro-batch planning and packing (no process group: these are the pure parts)."""

from __future__ import annotations

import pytest
import torch

from miles.training.batch import TrainBatch
from miles_fsdp.microbatch import count_micro_batches, pack, plan_micro_batches, token_logprobs


def test_count_uses_first_fit_decreasing_and_isolates_long_sequences() -> None:
    assert count_micro_batches([10, 10, 10, 10], 20) == 2
    assert count_micro_batches([15, 6, 5, 14], 20) == 2
    assert count_micro_batches([50, 3], 20) == 2  # the long one alone, over the budget
    assert count_micro_batches([], 20) == 0


@pytest.mark.parametrize(
    ("lengths", "budget", "bins"),
    [([10, 10, 10, 10], 20, 2), ([9, 8, 7, 3, 2], 12, 3), ([5, 5], 40, 4), ([30, 1, 1, 1], 20, 2), ([7], 4, 3)],
)
def test_plan_keeps_every_sequence_once_within_budget(lengths: list[int], budget: int, bins: int) -> None:
    plan = plan_micro_batches(lengths, budget, bins)
    assert len(plan) == bins
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    for members in plan:
        assert members == sorted(members)
        assert len(members) <= 1 or sum(lengths[i] for i in members) <= budget


def test_plan_balances_tokens_over_more_bins_than_needed() -> None:
    plan = plan_micro_batches([8, 8, 8, 8], 32, 2)
    assert [sum(8 for _ in b) for b in plan] == [16, 16]


def test_plan_refuses_fewer_bins_than_the_budget_allows() -> None:
    with pytest.raises(ValueError, match="need 2 micro-batches"):
        plan_micro_batches([10, 10], 10, 1)


def test_pack_restarts_positions_and_points_at_response_tokens() -> None:
    batch = TrainBatch.from_lists(tokens=[[1, 2, 3, 4], [5, 6, 7]], prompt_lengths=[2, 1], loss_mask=[[1, 1], [1, 0]])
    mb = pack(batch, [0, 1], torch.device("cpu"))
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert mb.keep_index.tolist() == [1, 2, 4, 5]  # logits at these positions predict 3, 4, 6, 7
    assert mb.targets.tolist() == [3, 4, 6, 7]
    assert mb.response_lengths == [2, 2]
    empty = pack(batch, [], torch.device("cpu"), pad_token_id=9)
    assert empty.is_empty and empty.input_ids.tolist() == [[9]] and empty.targets.numel() == 0


def test_pack_rejects_a_sequence_without_prompt_or_response() -> None:
    batch = TrainBatch.from_lists(tokens=[[1, 2]], prompt_lengths=[2], loss_mask=[[]])
    with pytest.raises(ValueError, match="sequence 0: prompt_lengths=2"):
        pack(batch, [0], torch.device("cpu"))


def test_token_logprobs_apply_temperature_in_fp32() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]], dtype=torch.bfloat16)
    targets = torch.tensor([0, 2])
    lp, ent = token_logprobs(logits, targets, 0.5, with_entropy=True)
    want = torch.log_softmax(logits.float() / 0.5, dim=-1)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, want[[0, 1], [0, 2]])
    torch.testing.assert_close(ent, -(want.exp() * want).sum(-1))
    greedy, _ = token_logprobs(logits, targets, 0.0, with_entropy=False)  # greedy: scored at temperature 1
    torch.testing.assert_close(greedy, torch.log_softmax(logits.float(), -1)[[0, 1], [0, 2]])
