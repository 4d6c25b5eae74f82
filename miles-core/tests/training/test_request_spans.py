"""Which engine request sampled which response token: how the batch packs ``Sample.request_spans`` and how a
trainer gets one sequence's spans back."""

from __future__ import annotations

import torch

from miles.training.batch import TrainBatch
from miles.training.request_spans import REQUEST_INDEX, pack_request_spans, spans_of
from miles.types import Sample


def sample(response: int, spans: list[tuple[int, int]]) -> Sample:
    mask = [0] * response
    for a, b in spans or [(0, response)]:
        mask[a:b] = [1] * (b - a)
    return Sample(
        prompt_ids=[1, 2],
        response_ids=list(range(3, 3 + response)),
        rollout_logprobs=[-1.0] * response,
        loss_mask=mask,
        request_spans=spans,
    )


def test_packing_and_recovering_the_spans() -> None:
    turns = sample(7, [(0, 2), (4, 6), (6, 7)])  # two adjacent turns (no tokens between them) stay two
    single = sample(3, [])
    packed = pack_request_spans([turns, single])
    assert packed is not None and packed.tolist() == [0, 0, -1, -1, 1, 1, 2, 0, 0, 0]
    assert pack_request_spans([single]) is None  # nothing to say: every sequence is one request
    batch = TrainBatch.from_samples([turns, single])
    assert torch.equal(batch.response_tensors[REQUEST_INDEX], packed)
    assert spans_of(batch.response_tensor_rows(REQUEST_INDEX, [0])) == [(0, 2), (4, 6), (6, 7)]  # type: ignore[arg-type]
    assert spans_of(batch.response_tensor_rows(REQUEST_INDEX, [1])) == [(0, 3)]  # type: ignore[arg-type]
    assert spans_of(batch.select([0]).response_tensor_rows(REQUEST_INDEX, [0])) == [(0, 2), (4, 6), (6, 7)]  # type: ignore[arg-type]
    assert spans_of(torch.tensor([-1, 0, 0, -1])) == [(1, 3)] and spans_of(torch.zeros(0, dtype=torch.int64)) == []
