"""Attention over a packed row, sequence by sequence (``attn_implementation = "packed_sdpa"``).

The trainers pack a micro-batch's sequences into one row whose ``position_ids`` restart at 0 for each
sequence. With Hugging Face's ``sdpa`` attention that row gets a ``[L, L]`` block-diagonal causal mask, and
SDPA computes every query against every key of the row and masks all but its own sequence's: for 8 sequences
of 64 tokens, 8x the arithmetic, plus the mask. :func:`packed_sdpa_attention` instead finds the sequences from
``position_ids`` and runs causal SDPA on each sequence alone (sequences of one length in one batched call),
with no mask at all — the same function, to float32 rounding (the kernel blocks the reduction differently).

It is registered with transformers' ``AttentionInterface`` (and a mask function that builds no mask) under
:data:`PACKED_SDPA`; models loaded with ``attn_implementation=PACKED_SDPA`` use it in every layer. It accepts
only what the trainers give it: one packed row, no padding mask, no cache, and a plain causal model
(sliding windows and logit soft-capping are refused by name).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["PACKED_SDPA", "packed_sdpa_attention", "register_packed_attention", "sequence_bounds"]

PACKED_SDPA = "miles_packed_sdpa"
"""The name of the attention implementation in transformers' registries."""


def sequence_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the sequences of one packed row (``position_ids`` ``[1, L]`` or ``[L]``, each
    sequence counting from 0)."""
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions == 0).reshape(-1).tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    ends = [*starts[1:], positions.numel()]
    return list(zip(starts, ends, strict=True))


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA per sequence of the packed row. ``query`` ``[1, H, L, D]``, ``key`` / ``value``
    ``[1, H_kv, L, D]``; returns ``([1, L, H, D], None)`` as transformers' attention functions do."""
    if kwargs.get("sliding_window") or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(
            f"attn_implementation 'packed_sdpa': {type(module).__name__} uses a sliding window, soft-capping or "
            "attention sinks, which it does not implement; use 'sdpa'"
        )
    if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError(
            "attn_implementation 'packed_sdpa' takes one packed row without a padding mask or a cache "
            f"(got query {tuple(query.shape)}, key {tuple(key.shape)}, mask {attention_mask is not None}); "
            "use 'sdpa' for padded batches or generation"
        )
    position_ids = kwargs.get("position_ids")
    total = query.shape[2]
    bounds = sequence_bounds(position_ids) if position_ids is not None else [(0, total)]
    gqa = key.shape[1] != query.shape[1]
    by_length: dict[int, list[int]] = {}
    for start, end in bounds:
        by_length.setdefault(end - start, []).append(start)
    pieces: list[tuple[list[int], int, torch.Tensor]] = []
    for length, starts in by_length.items():
        if len(starts) == 1:
            s = starts[0]
            q, k, v = query[:, :, s : s + length], key[:, :, s : s + length], value[:, :, s : s + length]
        else:
            q = torch.cat([query[:, :, s : s + length] for s in starts])
            k = torch.cat([key[:, :, s : s + length] for s in starts])
            v = torch.cat([value[:, :, s : s + length] for s in starts])
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=dropout if module.training else 0.0, scale=scaling, enable_gqa=gqa
        )
        pieces.append((starts, length, o))
    if len(pieces) == 1 and len(pieces[0][0]) == 1:
        out = pieces[0][2]
    else:
        parts: list[tuple[int, torch.Tensor]] = []
        for starts, _length, o in pieces:
            parts.extend((s, o[i : i + 1]) for i, s in enumerate(starts))
        parts.sort(key=lambda item: item[0])
        out = torch.cat([o for _, o in parts], dim=2)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of :data:`PACKED_SDPA`: no mask (the sequences are found from ``position_ids``)."""
    return None


_REGISTERED = False


def register_packed_attention() -> str:
    """Register :func:`packed_sdpa_attention` (and its mask function) with transformers, once; returns its
    name, the ``attn_implementation`` to load models with."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
        AttentionMaskInterface.register(PACKED_SDPA, _no_mask)
        _REGISTERED = True
    return PACKED_SDPA
