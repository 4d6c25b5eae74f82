"""Micro-batches packed by a token budget (dynamic batch size) and the per-token math on their logits.

Sequences of a micro-batch are concatenated into one row with ``position_ids`` that restart at 0 for
each sequence; Hugging Face models then attend within each sequence only. Every rank must run the same
number of forwards (each one all-gathers parameters), so the count is agreed over ranks first and a rank
with less data runs empty micro-batches (a one-token forward whose loss is multiplied by zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from miles.training.batch import TrainBatch
from miles.training.logit_masks import LOGIT_MASK_IDS
from miles.training.logprobs import token_logprobs, topk_logprobs
from miles.training.routing import ROUTED_EXPERTS
from miles_fsdp.packed_attention import Segment, VarlenLayout, packed_layout, varlen_layout

__all__ = ["PackedMicroBatch", "pack", "token_logprobs", "topk_logprobs"]


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
    segments: list[Segment] = field(default_factory=list)
    """The row's layout (:func:`~miles_fsdp.packed_attention.packed_layout`), computed from the positions on the
    host when the row was packed: ``packed_sdpa`` reads it instead of taking ``position_ids`` back from the
    device in every layer."""
    varlen: VarlenLayout | None = None
    """On CUDA: the same layout as one variable-length flash-attention call takes it
    (:func:`~miles_fsdp.packed_attention.varlen_layout`), copied to the device once per micro-batch."""

    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """More inputs of the forward, over ``position_ids`` (a vision-language actor's images and M-RoPE
    positions: :mod:`miles_fsdp.vision`)."""
    image_mask: torch.Tensor | None = None
    """``[1, L]`` the prompts' image placeholders (the tokens that take image features)."""

    @property
    def is_empty(self) -> bool:
        return not self.indices


def pack(
    batch: TrainBatch,
    indices: Sequence[int],
    device: torch.device,
    pad_token_id: int = 0,
    *,
    share_prefixes: bool = False,
) -> PackedMicroBatch:
    """Pack the sequences ``indices`` of ``batch`` into one row (a one-token dummy row when empty).

    ``share_prefixes``: sequences with the same prompt (a GRPO group's samples) hold it once, each response a
    branch whose positions continue the prompt's (:mod:`miles_fsdp.packed_attention`; the model must attend
    with ``packed_sdpa``). The first response token of each is predicted by the shared prompt's last position.
    Not with per-token routed experts (their prompt rows are each sample's own).
    """
    if not indices:
        one = torch.full((1, 1), pad_token_id, dtype=torch.long, device=device)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return PackedMicroBatch(
            one,
            torch.zeros_like(one),
            torch.zeros(1, dtype=torch.long, device=device),
            empty,
            [],
            [],
            segments=[Segment(0, 1, 0, 0)],
            varlen=varlen_layout([Segment(0, 1, 0, 0)], device) if torch.device(device).type == "cuda" else None,
        )
    starts = batch.seq_offsets.tolist()
    prompts = batch.prompt_lengths.tolist()
    routed = batch.token_tensor_rows(ROUTED_EXPERTS, indices, device)
    order = list(indices)
    families: list[list[int]] = [[i] for i in order]
    if share_prefixes and routed is None:
        by_prompt: dict[bytes, list[int]] = {}
        for i in order:
            prompt_ids = batch.tokens[starts[i] : starts[i] + prompts[i]]
            by_prompt.setdefault(prompt_ids.numpy().tobytes(), []).append(i)
        families = list(by_prompt.values())
        order = [i for family in families for i in family]
    pieces: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    keep: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    lengths: list[int] = []
    offset = 0
    for family in families:
        root_end = -1
        for i in family:
            tokens, prompt = batch.tokens[starts[i] : starts[i + 1]], prompts[i]
            n = tokens.numel()
            if prompt < 1 or prompt >= n:
                raise ValueError(
                    f"TrainBatch sequence {i}: prompt_lengths={prompt} but the sequence has {n} tokens "
                    "(need at least one prompt and one response token)"
                )
            if root_end < 0:  # the family's first sequence, whole
                pieces.append(tokens)
                positions.append(torch.arange(n))
                keep.append(torch.arange(offset + prompt - 1, offset + n - 1))
                root_end = offset + prompt  # its prompt's last position predicts every branch's first token
                offset += n
            else:  # the response alone, continuing the shared prompt's positions
                pieces.append(tokens[prompt:])
                positions.append(torch.arange(prompt, n))
                own = torch.arange(offset, offset + n - prompt - 1)
                keep.append(torch.cat([torch.tensor([root_end - 1]), own]))
                offset += n - prompt
            targets.append(tokens[prompt:])
            lengths.append(n - prompt)
    row_positions = torch.cat(positions)  # (on the host: its layout needs no copy back from the device)
    segments = packed_layout(row_positions)
    return PackedMicroBatch(
        input_ids=torch.cat(pieces).to(device=device, dtype=torch.long).unsqueeze(0),
        position_ids=row_positions.to(device).unsqueeze(0),
        keep_index=torch.cat(keep).to(device),
        targets=torch.cat(targets).to(device=device, dtype=torch.long),
        response_lengths=lengths,
        indices=order,
        mask_ids=batch.response_tensor_rows(LOGIT_MASK_IDS, order, device),
        routed_experts=routed,
        segments=segments,
        varlen=varlen_layout(segments, device) if torch.device(device).type == "cuda" else None,
    )
