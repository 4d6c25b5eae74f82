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
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist

from miles.training.batch import TrainBatch

__all__ = [
    "MicroBatch",
    "agree_count",
    "concat_batches",
    "make_micro_batch",
    "per_token_field",
    "plan_bins",
    "teacher_topk_rows",
    "token_logprobs",
    "topk_logprobs",
]


def plan_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing bins of sequence indices under ``budget`` tokens (a longer sequence gets a bin
    of its own); indices inside a bin sorted."""
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


def agree_count(count: int, device: torch.device) -> int:
    """The largest micro-batch count over the world (at least 1)."""
    value = torch.tensor([max(count, 1)], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


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
    width = max(len(batch.tokens[i]) for i in indices)
    width = -(-width // multiple) * multiple
    ids = torch.full((len(indices), width), pad_token_id, dtype=torch.long)
    rows: list[int] = []
    cols: list[int] = []
    targets: list[int] = []
    lengths: list[int] = []
    for r, i in enumerate(indices):
        tokens, prompt = batch.tokens[i], batch.prompt_lengths[i]
        if prompt < 1 or prompt >= len(tokens):
            raise ValueError(
                f"TrainBatch sequence {i}: prompt_lengths={prompt} but the sequence has {len(tokens)} tokens "
                "(need at least one prompt and one response token)"
            )
        ids[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        rows.extend([r] * (len(tokens) - prompt))
        cols.extend(range(prompt - 1, len(tokens) - 1))
        targets.extend(tokens[prompt:])
        lengths.append(len(tokens) - prompt)
    positions = torch.arange(width)[None].expand(len(indices), width).contiguous()
    return MicroBatch(
        input_ids=ids.to(device),
        position_ids=positions.to(device),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        cols=torch.tensor(cols, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        response_lengths=lengths,
        indices=list(indices),
    )


def concat_batches(parts: Sequence[TrainBatch]) -> TrainBatch:
    """One batch of the sequences of ``parts``, in order (a field is kept only when every part has it)."""
    first = parts[0]
    updates: dict[str, object] = {}
    for f in fields(first):
        values = [getattr(p, f.name) for p in parts]
        if f.name == "weight_versions":
            updates[f.name] = [v for value in values for v in value]
        elif any(v is None for v in values):
            updates[f.name] = None
        else:
            updates[f.name] = [row for value in values for row in value]
    return replace(first, **updates)  # type: ignore[arg-type]


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, *, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each target (and each distribution's entropy) from ``[T, V]`` logits.

    As the engine (and miles-fsdp) scores: ``logits / temperature``, then ``log_softmax`` in float32;
    greedy decoding (``temperature`` 0) is scored at temperature 1. The entropy has gradients only with
    ``entropy_grad``.
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


def topk_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[T, k]`` logprobs of the token ids ``ids`` under ``log_softmax(logits / temperature)`` (with gradient)."""
    scaled = logits.float()
    if temperature > 1e-6 and temperature != 1.0:
        scaled = scaled / temperature
    return scaled.gather(-1, ids) - torch.logsumexp(scaled, dim=-1, keepdim=True)


def per_token_field(batch: TrainBatch, name: str, indices: Sequence[int], device: torch.device) -> torch.Tensor | None:
    """The concatenated ``[T]`` float tensor of a per-response-token field for ``indices`` (``None`` if unset)."""
    rows = getattr(batch, name)
    if rows is None:
        return None
    return torch.tensor([float(v) for i in indices for v in rows[i]], dtype=torch.float32, device=device)


def teacher_topk_rows(
    batch: TrainBatch, indices: Sequence[int], k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's first ``k`` top-k ids and logprobs (``[T, k]`` each) of sequences ``indices``."""
    if batch.teacher_topk_ids is None or batch.teacher_topk_logprobs is None or batch.teacher_topk < k:
        have = "none" if batch.teacher_topk_ids is None else f"top-{batch.teacher_topk}"
        raise ValueError(f"the algorithm needs the teacher's top-{k} per response token, the batch has {have}")
    ids = [row[:k] for i in indices for row in batch.teacher_topk_ids[i]]
    logprobs = [row[:k] for i in indices for row in batch.teacher_topk_logprobs[i]]
    return (
        torch.tensor(ids, dtype=torch.long, device=device).reshape(-1, k),
        torch.tensor(logprobs, dtype=torch.float32, device=device).reshape(-1, k),
    )
