"""Micro-batches packed by a token budget (dynamic batch size) and the per-token math on their logits.

Sequences of a micro-batch are concatenated into one row with ``position_ids`` that restart at 0 for
each sequence; Hugging Face models then attend within each sequence only. Every rank must run the same
number of forwards (each one all-gathers parameters), so the count is agreed over ranks first and a rank
with less data runs empty micro-batches (a one-token forward whose loss is multiplied by zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles.training.batch import TrainBatch
from miles.training.logit_masks import LOGIT_MASK_IDS
from miles.training.logprobs import token_logprobs, topk_logprobs
from miles.training.routing import ROUTED_EXPERTS

__all__ = [
    "PackedMicroBatch",
    "agree_num_micro_batches",
    "count_micro_batches",
    "pack",
    "plan_micro_batches",
    "token_logprobs",
    "topk_logprobs",
]


def count_micro_batches(lengths: Sequence[int], budget: int) -> int:
    """Bins needed by first-fit-decreasing; a sequence longer than ``budget`` gets a bin of its own."""
    return len(_first_fit_decreasing(lengths, budget))


def _first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def plan_micro_batches(lengths: Sequence[int], budget: int, num_bins: int) -> list[list[int]]:
    """Split sequence indices into exactly ``num_bins`` micro-batches (some possibly empty).

    Balances tokens across bins (longest first onto the lightest bin) when that respects ``budget``,
    else falls back to first-fit-decreasing padded with empty bins. Indices inside a bin are sorted.
    """
    ffd = _first_fit_decreasing(lengths, budget)
    if num_bins < len(ffd):
        raise ValueError(f"{len(lengths)} sequences need {len(ffd)} micro-batches of {budget} tokens, got {num_bins}")
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min(range(num_bins), key=lambda b: (loads[b], b))
        bins[b].append(i)
        loads[b] += lengths[i]
    if any(load > budget and len(members) > 1 for load, members in zip(loads, bins, strict=True)):
        bins = ffd + [[] for _ in range(num_bins - len(ffd))]
    return [sorted(b) for b in bins]


def agree_num_micro_batches(lengths: Sequence[int], budget: int, device: torch.device) -> int:
    """The largest micro-batch count over ranks (at least 1), so every rank runs as many forwards."""
    count = torch.tensor([max(count_micro_batches(lengths, budget), 1)], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


@dataclass
class PackedMicroBatch:
    """One packed row: inputs of the forward and where the response tokens are."""

    input_ids: torch.Tensor
    """``[1, L]`` token ids of the concatenated sequences."""
    position_ids: torch.Tensor
    """``[1, L]`` positions, restarting at 0 for each sequence."""
    keep_index: torch.Tensor
    """``[T]`` positions whose logits predict a response token (``logits_to_keep``)."""
    targets: torch.Tensor
    """``[T]`` the response tokens those positions predict."""
    response_lengths: list[int]
    """Response tokens per sequence (sums to ``T``); empty for a dummy micro-batch."""
    indices: list[int]
    """Positions of the sequences in the batch they came from."""
    mask_ids: torch.Tensor | None = None
    """``[T, M]`` token ids the engine masked out of each response position's distribution (``-1``: none)."""
    routed_experts: torch.Tensor | None = None
    """``[L, layers, k]`` the engine's experts for each token of ``input_ids`` (``-1``: none), MoE only."""

    @property
    def is_empty(self) -> bool:
        return not self.indices


def pack(batch: TrainBatch, indices: Sequence[int], device: torch.device, pad_token_id: int = 0) -> PackedMicroBatch:
    """Pack the sequences ``indices`` of ``batch`` into one row (a one-token dummy row when empty)."""
    if not indices:
        one = torch.full((1, 1), pad_token_id, dtype=torch.long, device=device)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return PackedMicroBatch(
            one, torch.zeros_like(one), torch.zeros(1, dtype=torch.long, device=device), empty, [], []
        )
    starts = batch.seq_offsets.tolist()
    prompts = batch.prompt_lengths.tolist()
    pieces: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    keep: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    lengths: list[int] = []
    offset = 0
    for i in indices:
        tokens, prompt = batch.tokens[starts[i] : starts[i + 1]], prompts[i]
        n = tokens.numel()
        if prompt < 1 or prompt >= n:
            raise ValueError(
                f"TrainBatch sequence {i}: prompt_lengths={prompt} but the sequence has {n} tokens "
                "(need at least one prompt and one response token)"
            )
        pieces.append(tokens)
        positions.append(torch.arange(n))
        keep.append(torch.arange(offset + prompt - 1, offset + n - 1))
        targets.append(tokens[prompt:])
        lengths.append(n - prompt)
        offset += n
    return PackedMicroBatch(
        input_ids=torch.cat(pieces).to(device=device, dtype=torch.long).unsqueeze(0),
        position_ids=torch.cat(positions).to(device).unsqueeze(0),
        keep_index=torch.cat(keep).to(device),
        targets=torch.cat(targets).to(device=device, dtype=torch.long),
        response_lengths=lengths,
        indices=list(indices),
        mask_ids=batch.response_tensor_rows(LOGIT_MASK_IDS, indices, device),
        routed_experts=batch.token_tensor_rows(ROUTED_EXPERTS, indices, device),
    )
