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

__all__ = [
    "PackedMicroBatch",
    "agree_num_micro_batches",
    "count_micro_batches",
    "pack",
    "plan_micro_batches",
    "response_index",
    "teacher_topk_rows",
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
    )


def response_index(batch: TrainBatch, indices: Sequence[int]) -> torch.Tensor:
    """Positions in the batch's per-token fields of the response tokens of sequences ``indices``, in order."""
    offsets = batch.response_offsets
    parts = [torch.arange(offsets[i], offsets[i + 1]) for i in indices]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, *, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each target (and the entropy of each distribution) from ``[T, V]`` logits.

    As the engine scores: ``logits / temperature``, then ``log_softmax`` in float32; greedy decoding
    (``temperature`` 0) is scored at temperature 1. The entropy carries gradients only with
    ``entropy_grad`` (an entropy bonus); otherwise it is a detached metric.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scaled = logits.float()
    if temperature > 1e-6 and temperature != 1.0:
        scaled = scaled / temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    logprobs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        source = logp_all if entropy_grad else logp_all.detach()
        entropy = -(source.exp() * source).sum(-1)
    return logprobs, entropy


def per_token_field(batch: TrainBatch, name: str, indices: Sequence[int], device: torch.device) -> torch.Tensor | None:
    """The ``[T]`` float32 values of a per-response-token field for sequences ``indices`` (``None`` if unset)."""
    value = getattr(batch, name)
    if value is None:
        return None
    return value[response_index(batch, indices)].to(device=device, dtype=torch.float32)


def topk_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[T, k]`` logprobs of the token ids ``ids`` (``[T, k]``) under ``log_softmax(logits / temperature)``
    (fp32, greedy scored at temperature 1, as :func:`token_logprobs`), with gradient.

    Computed as ``gather - logsumexp`` so that no second ``[T, V]`` log-softmax is kept for backward.
    """
    scaled = logits.float()
    if temperature > 1e-6 and temperature != 1.0:
        scaled = scaled / temperature
    return scaled.gather(-1, ids) - torch.logsumexp(scaled, dim=-1, keepdim=True)


def teacher_topk_rows(
    batch: TrainBatch, indices: Sequence[int], k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's first ``k`` top-k ids and logprobs (``[T, k]`` each) of sequences ``indices``.

    Raises ``ValueError`` when the batch has no teacher top-k or fewer than ``k`` per position.
    """
    if batch.teacher_topk_ids is None or batch.teacher_topk_logprobs is None:
        raise ValueError(
            f"the algorithm needs the teacher's top-{k} (TrainBatch.teacher_topk_ids is None): "
            "score the samples with a teacher ([rollout.teacher] url, with top_k >= k)"
        )
    if batch.teacher_topk < k:
        raise ValueError(f"the algorithm needs the teacher's top-{k}; the batch has top-{batch.teacher_topk}")
    index = response_index(batch, indices)
    return (
        batch.teacher_topk_ids[index, :k].to(device=device, dtype=torch.long),
        batch.teacher_topk_logprobs[index, :k].to(device=device, dtype=torch.float32),
    )
