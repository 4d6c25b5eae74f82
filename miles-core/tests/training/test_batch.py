from __future__ import annotations

import pytest

from miles.training.batch import TrainBatch
from miles.types import Sample, WeightSpan


def _samples() -> list[Sample]:
    return [
        Sample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [1, 1, 0], weight_versions=[WeightSpan(0, 3, 2)]),
        Sample([1], [6], [-0.5], [1], weight_versions=[WeightSpan(0, 1, 3)]),
    ]


def test_from_samples_aligns_per_token_fields() -> None:
    batch = TrainBatch.from_samples(_samples(), advantages=[[1.0, 1.0, 1.0], [-1.0]])
    batch.validate()
    assert batch.tokens == [[1, 2, 3, 4, 5], [1, 6]]
    assert batch.prompt_lengths == [2, 1]
    assert batch.response_lengths == [3, 1]
    assert batch.num_tokens == 7
    assert batch.weight_versions == [2, 3]
    assert batch.teacher_logprobs is None


def test_shard_gives_each_rank_its_share() -> None:
    batch = TrainBatch.from_samples(_samples(), advantages=[[1.0, 1.0, 1.0], [-1.0]])
    first, second = batch.shard(0, 2), batch.shard(1, 2)
    assert first.tokens == [[1, 2, 3, 4, 5]] and second.tokens == [[1, 6]]
    assert second.advantages == [[-1.0]] and second.weight_versions == [3]
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        batch.shard(0, 3)


def test_validate_names_field_and_sequence() -> None:
    batch = TrainBatch.from_samples(_samples(), advantages=[[1.0, 1.0], [-1.0]])
    with pytest.raises(ValueError, match=r"TrainBatch.advantages\[0\] has 2 values, the response has 3 tokens"):
        batch.validate()


def test_teacher_topk_travels_from_samples_through_select() -> None:
    samples = _samples()
    samples[0].teacher_topk_ids = [[3, 7], [4, 1], [5, 5]]
    samples[0].teacher_topk_logprobs = [[-0.1, -2.0], [-0.3, -1.5], [-0.2, -0.9]]
    assert TrainBatch.from_samples(samples).teacher_topk_ids is None  # only when every sample has them
    samples[1].teacher_topk_ids = [[6, 2]]
    samples[1].teacher_topk_logprobs = [[-0.05, -3.0]]
    batch = TrainBatch.from_samples(samples, advantages=[[0.0] * 3, [0.0]])
    batch.validate()
    assert batch.teacher_topk == 2
    second = batch.shard(1, 2)
    assert second.teacher_topk_ids == [[[6, 2]]] and second.teacher_topk_logprobs == [[[-0.05, -3.0]]]
    assert batch.teacher_topk_logprobs is not None
    batch.teacher_topk_logprobs[0][2] = [-0.2]
    with pytest.raises(ValueError, match=r"TrainBatch.teacher_topk_logprobs\[0\]\[2\] has 1 entries, k is 2"):
        batch.validate()
    batch.teacher_topk_logprobs[0] = batch.teacher_topk_logprobs[0][:2]
    with pytest.raises(ValueError, match=r"teacher_topk_logprobs\[0\] has 2 rows, the response has 3 tokens"):
        batch.validate()
