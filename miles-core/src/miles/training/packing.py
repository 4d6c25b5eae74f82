"""Planning micro-batches by a token budget (dynamic batch size), the same for every trainer backend.

Sequences are assigned to bins under a budget of tokens by first-fit-decreasing (a sequence longer than the
budget gets a bin of its own). Every rank must run as many forwards (FSDP all-gathers parameters in each,
MoE all-to-alls and pipeline stages need every rank), so the count is agreed over the world first
(:func:`agree_max`) and a rank with less data runs empty micro-batches. How a bin becomes tensors (one
packed row, a padded block) is the backend's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["agree_max", "balanced_bins", "first_fit_decreasing"]


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of sequence indices under ``budget`` tokens, longest sequence first into the first bin it fits
    (indices inside a bin sorted)."""
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
    return [sorted(b) for b in bins]


def balanced_bins(lengths: Sequence[int], budget: int, num_bins: int) -> list[list[int]]:
    """Exactly ``num_bins`` bins (some possibly empty): tokens balanced across them (longest first onto the
    lightest bin) when that respects ``budget``, else :func:`first_fit_decreasing` padded with empty bins.
    Raises ``ValueError`` when ``num_bins`` is fewer than first-fit-decreasing needs."""
    ffd = first_fit_decreasing(lengths, budget)
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


def agree_max(count: int, device: torch.device) -> int:
    """The largest ``count`` over the world (at least 1): the micro-batch count every rank runs."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([max(count, 1)], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())
