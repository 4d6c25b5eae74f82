"""Attention over a packed row, sequence by sequence (``attn_implementation = "packed_sdpa"``), with shared
prompts.

The trainers pack a micro-batch's sequences into one row whose ``position_ids`` restart at 0 for each
sequence. With Hugging Face's ``sdpa`` attention that row gets a ``[L, L]`` block-diagonal causal mask, and
SDPA computes every query against every key of the row and masks all but its own sequence's: for 8 sequences
of 64 tokens, 8x the arithmetic, plus the mask. :func:`packed_sdpa_attention` instead reads the row's layout
from ``position_ids`` (:func:`packed_layout`) and runs causal SDPA on each sequence alone (sequences of one
length in one batched call), with no mask at all — the same function, to float32 rounding.

**Shared prompts.** The samples of a GRPO group share their prompt. A row may hold that prompt once and then
each sample's response as a *branch*: a segment whose positions do not restart at 0 but continue at ``p``
(the prompt's length) attends to the first ``p`` tokens of the segment that last started at 0 (its *root*)
and, causally, to itself. Every response then sees exactly the tokens it would see packed after its own copy
of the prompt — the prompt's hidden states do not depend on what follows them — so logprobs and gradients
are those of the unshared row (to float32 rounding), and the prompt is computed once per group instead of
once per sample (:func:`miles_fsdp.microbatch.pack` with ``share_prefixes``).

**On CUDA** the row goes through one variable-length flash-attention call instead (PyTorch's
``torch.nn.attention.varlen.varlen_attn``): the trainers give the forward a :class:`VarlenLayout` made once
per micro-batch (:func:`varlen_layout`: cumulative sequence starts, the longest query and key run, and for
branches the index that lays each one's prompt keys before its own), so no layer loops over segments or
waits for the device. The flash kernel's causal mask is aligned to the bottom right, which is exactly a
branch's view of its prompt and itself.

It is registered with transformers' ``AttentionInterface`` (and a mask function that builds no mask) under
:data:`PACKED_SDPA`; models loaded with ``attn_implementation=PACKED_SDPA`` use it in every layer. It accepts
only what the trainers give it: one packed row, no padding mask, no cache, and a plain causal model
(sliding windows and logit soft-capping are refused by name).
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "PACKED_SDPA",
    "Segment",
    "VarlenLayout",
    "packed_layout",
    "packed_sdpa_attention",
    "packed_unsupported",
    "register_packed_attention",
    "varlen_layout",
]

PACKED_SDPA = "miles_packed_sdpa"
"""The name of the attention implementation in transformers' registries."""


class Segment(NamedTuple):
    """A run of consecutive positions in a packed row."""

    start: int
    end: int
    prefix_start: int
    """Where the root this segment continues starts (its own ``start`` for a root)."""
    prefix_len: int
    """How many of the root's first tokens it attends to before itself (0: it is a root)."""


def packed_layout(position_ids: torch.Tensor) -> list[Segment]:
    """The segments of one packed row (``position_ids`` ``[1, L]`` or ``[L]``): a segment starts wherever a
    position is not its predecessor's plus one; one starting at 0 is a root (a sequence), one starting at
    ``p > 0`` is a branch that continues the first ``p`` tokens of the latest root."""
    positions = position_ids.reshape(-1)
    total = positions.numel()
    if total == 0:
        return []
    breaks = torch.nonzero(positions[1:] != positions[:-1] + 1).reshape(-1) + 1
    starts = [0, *breaks.tolist()]
    firsts = positions[starts].tolist()
    segments: list[Segment] = []
    root = -1
    for i, (start, first) in enumerate(zip(starts, firsts, strict=True)):
        end = starts[i + 1] if i + 1 < len(starts) else total
        if first == 0:
            root = start
            segments.append(Segment(start, end, start, 0))
            continue
        if root < 0 or first > _root_len(segments, root):
            raise ValueError(
                f"packed row: the segment at {start} continues position {first}, but "
                + ("no sequence starts before it" if root < 0 else "its root is shorter")
            )
        segments.append(Segment(start, end, root, first))
    return segments


class VarlenLayout(NamedTuple):
    """A packed row as one variable-length attention call sees it: sequence ``i``'s queries are rows
    ``cu_q[i]:cu_q[i+1]`` of the row, its keys rows ``cu_k[i]:cu_k[i+1]`` of the keys laid out by
    ``key_index`` (a root's own tokens; a branch's root prefix, then its own tokens)."""

    cu_q: torch.Tensor
    """``[N+1]`` int32, on the device."""
    cu_k: torch.Tensor
    """``[N+1]`` int32, on the device."""
    max_q: int
    max_k: int
    key_index: torch.Tensor | None
    """``[T_k]`` positions of the row that make the key sequence, on the device; ``None`` when every segment
    is a root (the keys are the row itself)."""


def varlen_layout(segments: list[Segment], device: torch.device | str) -> VarlenLayout:
    """The :class:`VarlenLayout` of a row's ``segments``, built on the host and copied to ``device`` once
    (the trainers call it when they pack a micro-batch, not in every layer)."""
    cu_q, cu_k, index = [0], [0], []
    for seg in segments:
        own = list(range(seg.start, seg.end))
        keys = list(range(seg.prefix_start, seg.prefix_start + seg.prefix_len)) + own
        cu_q.append(cu_q[-1] + len(own))
        cu_k.append(cu_k[-1] + len(keys))
        index.extend(keys)
    lengths_q = [b - a for a, b in itertools.pairwise(cu_q)]
    lengths_k = [b - a for a, b in itertools.pairwise(cu_k)]
    branched = any(seg.prefix_len for seg in segments)
    return VarlenLayout(
        cu_q=torch.tensor(cu_q, dtype=torch.int32).to(device, non_blocking=True),
        cu_k=torch.tensor(cu_k, dtype=torch.int32).to(device, non_blocking=True),
        max_q=max(lengths_q, default=0),
        max_k=max(lengths_k, default=0),
        key_index=torch.tensor(index, dtype=torch.long).to(device, non_blocking=True) if branched else None,
    )


def varlen_keys(t: torch.Tensor, layout: VarlenLayout) -> torch.Tensor:
    """``t`` (``[1, H, L, D]``, keys or values of the row) as the ``[T_k, H, D]`` key sequence of ``layout``."""
    rows = t[0].transpose(0, 1)
    return rows if layout.key_index is None else rows.index_select(0, layout.key_index)


def _varlen_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: VarlenLayout, scaling: float | None, gqa: bool
) -> torch.Tensor:
    """The row through PyTorch's variable-length flash attention (CUDA): ``[1, L, H, D]``."""
    from torch.nn.attention.varlen import varlen_attn

    out = varlen_attn(
        query[0].transpose(0, 1),
        varlen_keys(key, layout),
        varlen_keys(value, layout),
        layout.cu_q,
        layout.cu_k,
        layout.max_q,
        layout.max_k,
        scale=scaling,
        window_size=(-1, 0),  # causal, aligned to the bottom right: a branch sees its prompt and itself
        enable_gqa=gqa,
    )
    return out.unsqueeze(0)


def _root_len(segments: list[Segment], root: int) -> int:
    """Length of the root segment starting at ``root``."""
    for seg in segments:
        if seg.start == root:
            return seg.end - seg.start
    return 0


def _lower_right_causal(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """``[rows, cols]`` boolean mask: query ``j`` (the last ``rows`` of ``cols`` positions) sees keys ``<= cols
    - rows + j``."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).tril(diagonal=cols - rows)


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
    """Causal SDPA per segment of the packed row. ``query`` ``[1, H, L, D]``, ``key`` / ``value``
    ``[1, H_kv, L, D]``; returns ``([1, L, H, D], None)`` as transformers' attention functions do.

    The row's layout is the forward's ``packed_segments`` (the trainers compute it once per micro-batch, on
    the host, from the positions before they go to the device), else :func:`packed_layout` of
    ``position_ids``, which copies them back from the device in every layer. With the layout given, nothing
    here waits for the device: the segments' slices, SDPA calls and masks are all queued work. On CUDA, with
    the forward's ``packed_varlen`` (:func:`varlen_layout`) and no dropout, the row is one flash-attention
    call (:func:`_varlen_attention`)."""
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
    gqa = key.shape[1] != query.shape[1]
    p_drop = dropout if module.training else 0.0
    varlen: VarlenLayout | None = kwargs.get("packed_varlen")
    if varlen is not None and query.is_cuda and not p_drop:
        return _varlen_attention(query, key, value, varlen, scaling, gqa), None
    dtype = query.dtype
    if query.device.type == "cpu" and (dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled("cpu")):
        # PyTorch's CPU flash attention runs its bfloat16 backward ~3x slower than float32's (0.32 s of a 2.2 s
        # SmolLM2 train step on the development machine's Xeon): attend in float32 with autocast off (which
        # would cast SDPA's inputs to bfloat16 again), the result in the row's dtype
        with torch.autocast("cpu", enabled=False):
            out = _segments_attention(query.float(), key.float(), value.float(), p_drop, scaling, gqa, kwargs)
        return out.to(dtype), None
    return _segments_attention(query, key, value, p_drop, scaling, gqa, kwargs), None


def _segments_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    p_drop: float,
    scaling: float | None,
    gqa: bool,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """The packed row's causal SDPA, segment group by segment group, as ``[1, L, H, D]``."""
    position_ids = kwargs.get("position_ids")
    total = query.shape[2]
    segments: list[Segment] | None = kwargs.get("packed_segments")
    if segments is None:  # (the trainers pass the layout, computed on the host: this reads the device)
        segments = packed_layout(position_ids) if position_ids is not None else [Segment(0, total, 0, 0)]
    # segments of one shape go through SDPA together: roots by length, branches by (prefix, length)
    groups: dict[tuple[int, int], list[Segment]] = {}
    for seg in segments:
        groups.setdefault((seg.prefix_len, seg.end - seg.start), []).append(seg)
    # each tensor cut into its segments (which tile the row) by one split: its backward is one concatenation of
    # the segments' gradients, where a slice per segment would fill a zero gradient of the whole row for each (on
    # a GRPO micro-batch of SmolLM2, ~45 row-sized fills and additions a layer)
    starts, sizes = [seg.start for seg in segments], [seg.end - seg.start for seg in segments]
    cut = {
        name: dict(zip(starts, t.split(sizes, dim=2), strict=True))
        for name, t in (("q", query), ("k", key), ("v", value))
    }

    def part(name: str, start: int, length: int) -> torch.Tensor:
        """The first ``length`` rows of ``name``'s segment that starts at ``start``."""
        whole = cut[name][start]
        return whole if whole.shape[2] == length else whole[:, :, :length]

    pieces: list[tuple[int, torch.Tensor]] = []
    for (prefix, length), members in groups.items():

        def keys(name: str, seg: Segment, prefix: int = prefix) -> torch.Tensor:
            own = part(name, seg.start, seg.end - seg.start)
            if not prefix:
                return own
            return torch.cat([part(name, seg.prefix_start, prefix), own], dim=2)

        q = torch.cat([part("q", s.start, length) for s in members])
        k = torch.cat([keys("k", s) for s in members])
        v = torch.cat([keys("v", s) for s in members])
        if prefix:
            mask = _lower_right_causal(length, prefix + length, query.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p_drop, scale=scaling, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p_drop, scale=scaling, enable_gqa=gqa)
        pieces.extend((s.start, piece) for s, piece in zip(members, o.split(1), strict=True))
    if len(pieces) == 1:
        out = pieces[0][1]
    else:
        pieces.sort(key=lambda item: item[0])
        out = torch.cat([o for _, o in pieces], dim=2)
    return out.transpose(1, 2).contiguous()


def packed_unsupported(config: Any) -> str | None:
    """Why a model with this (Hugging Face) config cannot attend with :func:`packed_sdpa_attention`, or
    ``None``: sliding windows, attention logit soft-capping and attention sinks are not implemented."""
    if getattr(config, "vision_config", None) is not None:
        return f"{config.model_type} has a vision tower (whose attention has its own layout)"
    configs = [config, *(getattr(config, name, None) for name in ("text_config", "language_config"))]
    for cfg in filter(None, configs):
        layer_types = getattr(cfg, "layer_types", None) or []
        if getattr(cfg, "use_sliding_window", False) or any("sliding" in str(t) for t in layer_types):
            return f"{cfg.model_type} uses sliding-window attention"
        if getattr(cfg, "attn_logit_softcapping", None):
            return f"{cfg.model_type} soft-caps its attention logits"
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", None) is None:
            return f"{cfg.model_type} uses sliding-window attention"
    return None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of :data:`PACKED_SDPA`: no mask (the layout is read from ``position_ids``)."""
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
