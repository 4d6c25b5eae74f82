"""The engine's logit masks: what the rollout records, how the batch packs them, what the trainer's logprob
math does with them; and the fidelity facts of a sample surviving its JSON form (buffers, checkpoints)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.rollout.facts import logit_masks
from miles.rollout.protocol import SamplingParams
from miles.training.batch import TrainBatch
from miles.training.logit_masks import LOGIT_MASK_IDS, apply_logit_masks, pack_logit_masks
from miles.training.logprobs import scoring_temperature, token_logprobs
from miles.types import LogitMask, Sample


def test_recorded_masks_follow_min_new_tokens() -> None:
    params = SamplingParams(max_new_tokens=8, min_new_tokens=3, stop_token_ids=[9, 2])
    assert logit_masks(params, [2, 0], length=6) == [LogitMask((0, 2, 9), 0, 3)]
    assert logit_masks(params, [0], start=4, length=2) == [LogitMask((0, 2, 9), 4, 6)]  # a later turn, cut short
    assert logit_masks(SamplingParams(max_new_tokens=8), [0], length=6) == []
    assert logit_masks(params, [], length=0) == []


def test_packing_and_applying() -> None:
    a = Sample(
        prompt_ids=[1],
        response_ids=[4, 5, 6],
        loss_mask=[1, 1, 1],
        rollout_logprobs=[-1.0] * 3,
        logit_masks=[LogitMask((0, 2), 0, 2)],
    )
    b = Sample(prompt_ids=[1], response_ids=[7, 8], loss_mask=[1, 1], rollout_logprobs=[-1.0] * 2)
    packed = pack_logit_masks([a, b])
    assert packed is not None and packed.tolist() == [[0, 2], [0, 2], [-1, -1], [-1, -1], [-1, -1]]
    assert pack_logit_masks([b]) is None
    batch = TrainBatch.from_samples([a, b])
    assert torch.equal(batch.response_tensors[LOGIT_MASK_IDS], packed)
    assert torch.equal(batch.select([1]).response_tensors[LOGIT_MASK_IDS], packed[3:])

    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(0))
    masked = apply_logit_masks(logits, packed)
    assert bool(torch.isinf(masked[:2, [0, 2]]).all()) and torch.equal(masked[2:], logits[2:])
    targets = torch.tensor([4, 5, 6, 7, 8])
    lp, ent = token_logprobs(logits, targets, 0.7, True, mask_ids=packed)
    want = torch.log_softmax(masked / 0.7, -1).gather(-1, targets[:, None])[:, 0]
    assert torch.equal(lp, want)
    assert ent is not None and bool(torch.isfinite(ent).all())  # masked ids contribute 0, not nan
    with pytest.raises(ValueError, match="token id 12 is outside the vocabulary of 10"):
        apply_logit_masks(logits, torch.full((5, 1), 12))


def test_scoring_temperature() -> None:
    assert scoring_temperature(0.8) == 0.8
    assert scoring_temperature(0.0) == scoring_temperature(0.8, top_k=1) == 1.0
    assert scoring_temperature(0.8, original_logprobs=True) == 1.0


def test_fidelity_facts_survive_json() -> None:
    routed = np.arange(3 * 2 * 2, dtype=np.int32).reshape(3, 2, 2)
    s = Sample(
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        logit_masks=[LogitMask((0, 5), 0, 1)],
        routed_experts=routed.tobytes(),
        routed_experts_shape=(3, 2, 2),
    )
    again = Sample.from_json(s.to_json())
    assert again.logit_masks == s.logit_masks
    assert again.routed_experts == s.routed_experts and again.routed_experts_shape == (3, 2, 2)
    with pytest.raises(ValueError, match=r"positions \[0, 5\) are outside the 2 response tokens"):
        Sample(
            prompt_ids=[1],
            response_ids=[3, 4],
            rollout_logprobs=[-1.0, -1.0],
            loss_mask=[1, 1],
            logit_masks=[LogitMask((0,), 0, 5)],
        ).validate()


def test_kept_sets_renormalise_the_trainers_distribution() -> None:
    """Sampling-mask replay: a sample's kept sets ride in the mask rows (``-2 - id``) next to its EOS mask;
    the trainer's logprob of each token becomes its logprob under the kept set renormalised, at the
    temperature, exactly what the engine reports as the behaviour logprob; rows without a kept set stay
    whole; a kept id outside the vocabulary is refused."""
    torch.manual_seed(0)
    vocab = 16
    sample = Sample(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        rollout_logprobs=[0.0] * 3,
        loss_mask=[1, 1, 1],
        logit_masks=[LogitMask((9,), 0, 1)],
        sampling_mask=[[3, 7, 2], [4, 1], []],
    )
    assert Sample.from_json(sample.to_json()) == sample
    other = Sample(prompt_ids=[1], response_ids=[6], rollout_logprobs=[0.0], loss_mask=[1])
    batch = TrainBatch.from_samples([sample, other])
    rows = batch.response_tensors[LOGIT_MASK_IDS]
    assert rows.tolist()[0][:4] == [9, -4, -5, -9] and rows.tolist()[2][0] == -1 and rows.tolist()[3][0] == -1
    logits = torch.randn(4, vocab)
    targets = torch.tensor([3, 4, 5, 6])
    scored, _ = token_logprobs(logits, targets, 0.7, False, mask_ids=rows)
    probs = torch.softmax(logits.double() / 0.7, -1)
    for row, kept in ((0, [3, 7, 2]), (1, [4, 1])):
        expected = torch.log(probs[row, targets[row]] / probs[row, kept].sum())
        assert float(scored[row]) == pytest.approx(float(expected), abs=1e-6)
    whole = torch.log_softmax(logits / 0.7, -1)
    assert torch.allclose(scored[2:], whole[[2, 3], targets[2:]])
    masked = apply_logit_masks(logits, rows)
    assert torch.isinf(masked[0]).sum() == vocab - 3  # the kept set alone (EOS 9 was outside it anyway)
    with pytest.raises(ValueError, match="outside the vocabulary of 16"):
        apply_logit_masks(logits, torch.tensor([[-2 - 16]] * 4))
    with pytest.raises(ValueError, match="Sample.sampling_mask has 1 rows"):
        Sample(
            prompt_ids=[1], response_ids=[6, 7], rollout_logprobs=[0.0] * 2, loss_mask=[1, 1], sampling_mask=[[6]]
        ).validate()
