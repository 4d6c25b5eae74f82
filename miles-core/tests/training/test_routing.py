"""Routed experts in the batch (packing, selection, the wire) and the router replay's choice and gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.training.batch import TrainBatch
from miles.training.routing import ROUTED_EXPERTS, RouterReplay, RoutingStats, pack_routed_experts
from miles.types import Sample


def sample(prompt: list[int], response: list[int], routed: np.ndarray | None) -> Sample:
    s = Sample(
        prompt_ids=prompt, response_ids=response, rollout_logprobs=[-1.0] * len(response), loss_mask=[1] * len(response)
    )
    if routed is not None:
        s.routed_experts = routed.astype(np.int32).tobytes()
        s.routed_experts_shape = routed.shape  # type: ignore[assignment]
    return s


def test_packing_aligns_rows_with_tokens_and_follows_the_batch() -> None:
    a = np.arange(4 * 2 * 2).reshape(4, 2, 2) % 7  # 5 tokens: the last is never routed
    b = np.arange(2 * 2 * 2).reshape(2, 2, 2) % 5 + 1  # 3 tokens
    samples = [sample([1, 2, 3], [4, 5], a), sample([6], [7, 8], b), sample([9, 9], [1], None)]
    batch = TrainBatch.from_samples(samples)
    routed = batch.token_tensors[ROUTED_EXPERTS]
    assert routed.dtype == torch.int16 and tuple(routed.shape) == (11, 2, 2)
    assert torch.equal(routed[:4], torch.from_numpy(a).to(torch.int16))
    assert torch.equal(routed[5:7], torch.from_numpy(b).to(torch.int16))
    assert bool((routed[4] == -1).all()) and bool((routed[7:] == -1).all())
    assert torch.equal(batch.token_tensor_rows(ROUTED_EXPERTS, [1]), routed[5:8])  # type: ignore[arg-type]
    picked = batch.select([1])
    assert torch.equal(picked.token_tensors[ROUTED_EXPERTS], routed[5:8])
    again = TrainBatch.from_tensors(batch.to_tensors())
    assert torch.equal(again.token_tensors[ROUTED_EXPERTS], routed)
    both = TrainBatch.concat([batch.select([0]), batch.select([2])])
    assert torch.equal(both.token_tensors[ROUTED_EXPERTS], torch.cat([routed[:5], routed[8:]]))
    assert pack_routed_experts([samples[2]]) is None


def test_packing_refuses_rows_beyond_the_sequence() -> None:
    with pytest.raises(ValueError, match="routed_experts has 6 rows for a sequence of 3 tokens"):
        pack_routed_experts([sample([1], [2, 3], np.zeros((6, 1, 1)))])


def test_select_replays_where_recorded_with_the_gate_gradient() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0], [1.0, 0.0, 0.0, 2.0]], requires_grad=True)
    probs = torch.softmax(logits, -1)
    rows = torch.tensor([[[2, 3]], [[3, 2]], [[-1, -1]]], dtype=torch.int16)  # token 2: no rollout data
    replay = RouterReplay(replay=True, num_layers=1)
    replay.set_rows(rows)
    weights, indices = replay.select(0, probs, 2)
    assert indices.tolist() == [[2, 3], [3, 2], [3, 0]]
    torch.testing.assert_close(weights, probs.gather(-1, indices))
    weights.sum().backward()
    assert logits.grad is not None and float(logits.grad.abs().sum()) > 0
    # agreement counts sets of experts: token 1 agrees (same pair), token 0 does not, token 2 is not counted
    assert replay.stats.metrics(1, reduce=False) == {
        "fidelity/routing_agreement": 0.5,
        "fidelity/routing_agreement_layer0": 0.5,
    }
    off = RouterReplay(replay=False)
    off.set_rows(rows)
    assert off.select(0, probs.detach(), 2)[1].tolist() == [[0, 1], [3, 2], [3, 0]]
    with pytest.raises(ValueError, match="router 0 sees 2 tokens, the batch has rollout experts for 3"):
        off.select(0, probs.detach()[:2], 2)


def test_stats_are_empty_without_data() -> None:
    assert RoutingStats().metrics(2, reduce=False) == {}
