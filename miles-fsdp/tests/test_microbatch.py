"""Packing a micro-batch into one row (no process group: the pure parts; planning is miles.training.packing's)."""

from __future__ import annotations

import pytest
import torch

from miles.training.batch import TrainBatch
from miles_fsdp.microbatch import pack, token_logprobs


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


def test_pack_shares_a_prompt_and_branches_each_response_off_it() -> None:
    """Samples 0 and 2 share the prompt [1, 2]: it is held once, sample 2's response continues its positions,
    and its first token is predicted by the prompt's last position (kept twice)."""
    batch = TrainBatch.from_lists(
        tokens=[[1, 2, 3, 4], [5, 6, 7], [1, 2, 8, 9]], prompt_lengths=[2, 1, 2], loss_mask=[[1, 1], [1, 0], [1, 1]]
    )
    mb = pack(batch, [0, 1, 2], torch.device("cpu"), share_prefixes=True)
    assert mb.indices == [0, 2, 1]  # a family together, in the order of its first member
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 8, 9, 5, 6, 7]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 0, 1, 2]]
    assert mb.keep_index.tolist() == [1, 2, 1, 4, 6, 7]
    assert mb.targets.tolist() == [3, 4, 8, 9, 6, 7]
    assert mb.response_lengths == [2, 2, 2]
    whole = pack(batch, [0, 1, 2], torch.device("cpu"))
    assert whole.input_ids.numel() == 11 and whole.indices == [0, 1, 2]


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
