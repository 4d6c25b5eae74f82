from __future__ import annotations

import pytest
import torch

from miles.training.batch import TrainBatch
from miles.types import Sample, TensorData, WeightSpan


def _samples() -> list[Sample]:
    return [
        Sample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [1, 1, 0], weight_versions=[WeightSpan(0, 3, 2)]),
        Sample([1], [6], [-0.5], [1], weight_versions=[WeightSpan(0, 1, 3)]),
    ]


def test_from_samples_aligns_per_token_fields() -> None:
    batch = TrainBatch.from_samples(_samples(), advantages=[[1.0, 1.0, 1.0], [-1.0]])
    assert batch.sequences() == [[1, 2, 3, 4, 5], [1, 6]]
    assert batch.tokens.tolist() == [1, 2, 3, 4, 5, 1, 6] and batch.seq_offsets.tolist() == [0, 5, 7]
    assert batch.prompt_lengths.tolist() == [2, 1]
    assert batch.response_lengths == [3, 1]
    assert batch.response_offsets == [0, 3, 4]
    assert batch.num_tokens == 7
    assert batch.weight_versions.tolist() == [2, 3]
    assert batch.teacher_logprobs is None
    assert batch.loss_mask.tolist() == [1.0, 1.0, 0.0, 1.0] and batch.loss_mask.dtype == torch.float32
    assert batch.rollout_logprobs is not None
    assert batch.rollout_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.5])
    rows = batch.rows("advantages")
    assert rows is not None and [r.tolist() for r in rows] == [[1.0, 1.0, 1.0], [-1.0]]


def test_shard_gives_each_rank_its_share() -> None:
    batch = TrainBatch.from_samples(_samples(), advantages=[[1.0, 1.0, 1.0], [-1.0]])
    first, second = batch.shard(0, 2), batch.shard(1, 2)
    assert first.sequences() == [[1, 2, 3, 4, 5]] and second.sequences() == [[1, 6]]
    assert second.advantages is not None and second.advantages.tolist() == [-1.0]
    assert second.weight_versions.tolist() == [3] and second.loss_mask.tolist() == [1.0]
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        batch.shard(0, 3)


def test_validation_names_field_and_sequence() -> None:
    with pytest.raises(ValueError, match=r"TrainBatch.advantages\[0\] has 2 values, the response has 3 tokens"):
        TrainBatch.from_samples(_samples(), advantages=[[1.0, 1.0], [-1.0]])
    batch = TrainBatch.from_samples(_samples())
    with pytest.raises(ValueError, match=r"TrainBatch.old_logprobs: rows of \[3, 2\] values for responses of \[3, 1\]"):
        batch.set_token_field("old_logprobs", [torch.zeros(3), torch.zeros(2)])
    with pytest.raises(ValueError, match=r"TrainBatch.ref_logprobs has shape \(5,\), the batch has 4 response tokens"):
        batch.set_token_field("ref_logprobs", torch.zeros(5))
    batch.set_token_field("old_logprobs", [torch.zeros(3), torch.ones(1)])
    assert batch.old_logprobs is not None and batch.old_logprobs.tolist() == [0.0, 0.0, 0.0, 1.0]


def test_teacher_topk_travels_from_samples_through_select() -> None:
    samples = _samples()
    samples[0].teacher_topk_ids = [[3, 7], [4, 1], [5, 5]]
    samples[0].teacher_topk_logprobs = [[-0.1, -2.0], [-0.3, -1.5], [-0.2, -0.9]]
    assert TrainBatch.from_samples(samples).teacher_topk_ids is None  # only when every sample has them
    samples[1].teacher_topk_ids = [[6, 2]]
    samples[1].teacher_topk_logprobs = [[-0.05, -3.0]]
    batch = TrainBatch.from_samples(samples, advantages=[[0.0] * 3, [0.0]])
    assert batch.teacher_topk == 2
    second = batch.shard(1, 2)
    assert second.teacher_topk_ids is not None and second.teacher_topk_logprobs is not None
    assert second.teacher_topk_ids.tolist() == [[6, 2]]
    torch.testing.assert_close(second.teacher_topk_logprobs, torch.tensor([[-0.05, -3.0]]))
    bad = [[[-0.1, -2.0], [-0.3, -1.5], [-0.2]], [[-0.05, -3.0]]]
    with pytest.raises(ValueError, match=r"TrainBatch.teacher_topk_logprobs\[0\]\[2\] has 1 entries, k is 2"):
        TrainBatch.from_lists(
            tokens=[[1, 2, 3, 4, 5], [1, 6]],
            prompt_lengths=[2, 1],
            loss_mask=[[1, 1, 0], [1]],
            teacher_topk_ids=[[[3, 7], [4, 1], [5, 5]], [[6, 2]]],
            teacher_topk_logprobs=bad,
        )
    with pytest.raises(ValueError, match=r"teacher_topk_logprobs\[0\] has 2 rows, the response has 3 tokens"):
        TrainBatch.from_lists(
            tokens=[[1, 2, 3, 4, 5], [1, 6]],
            prompt_lengths=[2, 1],
            loss_mask=[[1, 1, 0], [1]],
            teacher_topk_ids=[[[3, 7], [4, 1], [5, 5]], [[6, 2]]],
            teacher_topk_logprobs=[bad[0][:2], bad[1]],
        )


def test_tensors_round_trip_exactly() -> None:
    batch = TrainBatch.from_samples(_samples(), advantages=[[1.0, 1.0, 1.0], [-1.0]])
    again = TrainBatch.from_tensors(batch.to_tensors())
    for name, value in batch.to_tensors().items():
        assert torch.equal(getattr(again, name), value), name
    with pytest.raises(ValueError, match="seq_offsets end at 7, tokens has 6"):
        TrainBatch.from_tensors({**batch.to_tensors(), "tokens": batch.tokens[:6]})


def _tensor_data(t: torch.Tensor) -> TensorData:
    return TensorData(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.contiguous().numpy().tobytes())


def test_response_tensors_travel_from_samples_through_select_and_ranks() -> None:
    samples = _samples()
    latents = [torch.arange(3 * 2 * 2, dtype=torch.float32).reshape(3, 2, 2), torch.full((1, 2, 2), -1.5)]
    for sample, rows in zip(samples, latents, strict=True):
        sample.response_tensors = {"latents": _tensor_data(rows), "step": _tensor_data(torch.arange(len(rows)))}
    failed = Sample([9], [], [], [])  # a failed rollout: no response, no tensors
    batch = TrainBatch.from_samples([*samples, failed])
    assert batch.response_tensors["latents"].shape == (4, 2, 2)
    assert torch.equal(batch.response_tensors["latents"], torch.cat(latents))
    assert batch.response_tensors["step"].dtype == torch.int64 and batch.response_tensors["step"].tolist() == [
        0,
        1,
        2,
        0,
    ]
    second = batch.select([1])
    assert torch.equal(second.response_tensors["latents"], latents[1])
    wire = batch.to_tensors()
    assert "response_tensors.latents" in wire and "response_tensors" not in wire
    again = TrainBatch.from_tensors(wire)
    assert torch.equal(again.response_tensors["latents"], batch.response_tensors["latents"])


def test_response_tensors_are_checked() -> None:
    samples = _samples()
    samples[0].response_tensors = {"latents": _tensor_data(torch.zeros(3, 2))}
    with pytest.raises(ValueError, match=r"response_tensors\['latents'\]: sample 1 has none"):
        TrainBatch.from_samples(samples)
    samples[1].response_tensors = {"latents": _tensor_data(torch.zeros(1, 3))}
    with pytest.raises(ValueError, match=r"response_tensors\['latents'\]\[1\] is torch.float32 \(3,\) per token"):
        TrainBatch.from_samples(samples)
    batch = TrainBatch.from_samples(_samples())
    with pytest.raises(ValueError, match=r"response_tensors\['x'\] has shape \(3,\), the batch has 4 response tokens"):
        TrainBatch(
            batch.tokens,
            batch.seq_offsets,
            batch.prompt_lengths,
            batch.loss_mask,
            response_tensors={"x": torch.zeros(3)},
        )
