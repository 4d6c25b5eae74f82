"""Micro-batches by a token budget (dynamic batch size) and the per-token math on their logits.

A micro-batch is a ``[b, s]`` block of sequences, right-padded to the longest one (rounded up to a
multiple of the tensor-parallel size, which sequence parallel needs). Megatron's causal mask is then
exact for every real token: a token never attends to the padding after it, and RoPE positions start at 0
in every row as in Hugging Face. Sequences are assigned by first-fit-decreasing under the budget of real
tokens; the micro-batch count is agreed over the world (MoE all-to-alls and pipeline stages need every
rank to run as many), and a rank with less data runs empty micro-batches (one padding token, loss x 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles.training.batch import TrainBatch
from miles.training.logit_masks import LOGIT_MASK_IDS
from miles.training.routing import ROUTED_EXPERTS

__all__ = ["MicroBatch", "make_micro_batch"]


@dataclass
class MicroBatch:
    """One ``[b, s]`` block: inputs of the forward and where the response tokens are."""

    input_ids: torch.Tensor
    """``[b, s]`` token ids, right-padded."""
    position_ids: torch.Tensor
    """``[b, s]`` positions 0.. in every row."""
    rows: torch.Tensor
    """``[T]`` row of each position whose logits predict a response token."""
    cols: torch.Tensor
    """``[T]`` column of that position."""
    targets: torch.Tensor
    """``[T]`` the response tokens those positions predict."""
    response_lengths: list[int]
    """Response tokens per sequence (sums to ``T``); empty for a dummy micro-batch."""
    indices: list[int]
    """Positions of the sequences in the batch they came from."""
    mask_ids: torch.Tensor | None = None
    """``[T, M]`` the token ids the engine masked out of each response position's distribution (``-1``: none;
    :data:`~miles.training.logit_masks.LOGIT_MASK_IDS`), or ``None``."""
    routed_experts: torch.Tensor | None = None
    """``[b, s, layers, k]`` the engine's experts of each position (``-1``: none, and the padding), or ``None``
    when the batch has no routing data (:data:`~miles.training.routing.ROUTED_EXPERTS`)."""

    @property
    def is_empty(self) -> bool:
        return not self.indices


def make_micro_batch(
    batch: TrainBatch, indices: Sequence[int], device: torch.device, *, pad_token_id: int, multiple: int
) -> MicroBatch:
    """Lay the sequences ``indices`` of ``batch`` out as a right-padded block (one padding token if empty)."""
    if not indices:
        ids = torch.full((1, multiple), pad_token_id, dtype=torch.long, device=device)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        positions = torch.arange(multiple, device=device)[None]
        return MicroBatch(ids, positions, empty, empty, empty, [], [])
    all_lengths, prompts = batch.lengths, batch.prompt_lengths.tolist()
    width = max(all_lengths[i] for i in indices)
    width = -(-width // multiple) * multiple
    ids = torch.full((len(indices), width), pad_token_id, dtype=torch.long)
    rows: list[int] = []
    cols: list[int] = []
    pieces: list[torch.Tensor] = []
    lengths: list[int] = []
    for r, i in enumerate(indices):
        tokens, prompt, n = batch.sequence(i), prompts[i], all_lengths[i]
        if prompt < 1 or prompt >= n:
            raise ValueError(
                f"TrainBatch sequence {i}: prompt_lengths={prompt} but the sequence has {n} tokens "
                "(need at least one prompt and one response token)"
            )
        ids[r, :n] = tokens
        rows.extend([r] * (n - prompt))
        cols.extend(range(prompt - 1, n - 1))
        pieces.append(tokens[prompt:])
        lengths.append(n - prompt)
    positions = torch.arange(width)[None].expand(len(indices), width).contiguous()
    routed = None
    if ROUTED_EXPERTS in batch.token_tensors:
        table = batch.token_tensors[ROUTED_EXPERTS]
        routed = torch.full((len(indices), width, *table.shape[1:]), -1, dtype=table.dtype)
        for r, i in enumerate(indices):
            experts = batch.token_tensor_rows(ROUTED_EXPERTS, [i])
            assert experts is not None
            routed[r, : experts.shape[0]] = experts
    return MicroBatch(
        input_ids=ids.to(device),
        position_ids=positions.to(device),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        cols=torch.tensor(cols, dtype=torch.long, device=device),
        targets=torch.cat(pieces).to(device=device, dtype=torch.long),
        response_lengths=lengths,
        indices=list(indices),
        mask_ids=batch.response_tensor_rows(LOGIT_MASK_IDS, indices, device),
        routed_experts=routed,
    )
