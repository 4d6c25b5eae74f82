"""The trainer's forward on the batch-invariant ops (``train.true_on_policy``): the engine's numbers, with gradients.

The local engine in deterministic mode computes with :mod:`miles.engine.invariant`, whose ops give a token the
same bits whatever else is in the call: a decode step of one request, a batch of requests, or a packed training
micro-batch. :func:`install_invariant_forward` makes the Hugging Face actor compute with the same ops, in its
own differentiable forward: every ``nn.Linear`` (the projections, the LM head), every RMSNorm (the decoder's and
Qwen3's per-head q / k norms) and the MLPs' SiLU; the attention is :data:`INVARIANT_ATTENTION`, registered with
transformers, which runs :func:`miles.engine.invariant.attention` on each sequence of the packed row (a shared
prompt's branches included: a branch's keys are its root's first tokens and its own). The rotary embedding,
the residual adds and the log-softmax over the vocabulary are the model's and the trainer's own ops, which
already round a token the same way in every call.

So the trainer's logprobs of a rollout's tokens are the engine's bit for bit, in one forward over the packed
micro-batch, and the gradient is that forward's. Covered: dense Llama / Qwen2 / Qwen3 / Mistral with SiLU and
Qwen2-MoE / Qwen3-MoE (their expert blocks through :func:`miles.engine.invariant.install_moe`, the routers through
:func:`miles_fsdp.routing.patch_routers` with routing replay as set), in float32 on CPU; :func:`invariant_unsupported` says why another model is not (the trainer then replays the
engine, :mod:`miles_fsdp.true_on_policy`).
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
from torch import nn

from miles.engine import invariant
from miles_fsdp.packed_attention import Segment, packed_layout

__all__ = ["INVARIANT_ATTENTION", "install_invariant_forward", "invariant_unsupported", "register_invariant_attention"]

log = logging.getLogger(__name__)

INVARIANT_ATTENTION = "miles_invariant"
"""The attention implementation's name in transformers' registries."""
_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", *invariant.MOE_MODEL_TYPES)
_RMS_NORMS = tuple(f"{m}RMSNorm" for m in ("Llama", "Mistral", "Qwen2", "Qwen3"))


def invariant_unsupported(config: Any, param_dtype: torch.dtype, device: str) -> str | None:
    """Why the invariant forward cannot compute this model's engine numbers here, or ``None``."""
    if device != "cpu":
        return f"the batch-invariant ops run on CPU (the trainer runs on {device})"
    if param_dtype != torch.float32:
        return f"the batch-invariant forward is float32 (the precision recipe trains in {param_dtype})"
    if config.model_type not in _MODEL_TYPES:
        return f"model_type {config.model_type!r} is not covered (dense {', '.join(_MODEL_TYPES)} are)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"the activation {config.hidden_act!r} is not covered (silu is)"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention is not covered"
    return invariant.invariance_problem()


def _segment_keys(t: torch.Tensor, seg: Segment) -> torch.Tensor:
    own = t[:, :, seg.start : seg.end]
    if not seg.prefix_len:
        return own
    return torch.cat([t[:, :, seg.prefix_start : seg.prefix_start + seg.prefix_len], own], dim=2)


def invariant_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`miles.engine.invariant.attention` on each sequence of one packed row (``query`` ``[1, H, L, D]``,
    ``key`` / ``value`` ``[1, H_kv, L, D]``; the row's layout from the forward's ``packed_segments``, else from
    ``position_ids``); returns ``([1, L, H, D], None)`` as transformers' attention functions do."""
    if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        raise ValueError(
            f"attn_implementation {INVARIANT_ATTENTION!r} takes one packed row without a padding mask or a cache "
            f"(got query {tuple(query.shape)}, key {tuple(key.shape)}, mask {attention_mask is not None})"
        )
    if dropout and module.training:
        raise ValueError(f"attn_implementation {INVARIANT_ATTENTION!r}: attention dropout is not batch-invariant")
    total = query.shape[2]
    segments: list[Segment] | None = kwargs.get("packed_segments")
    if segments is None:
        position_ids = kwargs.get("position_ids")
        segments = packed_layout(position_ids) if position_ids is not None else [Segment(0, total, 0, 0)]
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    groups: dict[tuple[int, int], list[Segment]] = {}  # segments of one shape in one call (rows are independent)
    for seg in segments:
        groups.setdefault((seg.prefix_len, seg.end - seg.start), []).append(seg)
    pieces: list[tuple[int, torch.Tensor]] = []
    for (prefix, length), members in groups.items():
        q = torch.cat([query[:, :, s.start : s.end] for s in members])
        k = torch.cat([_segment_keys(key, s) for s in members])
        v = torch.cat([_segment_keys(value, s) for s in members])
        positions = torch.arange(prefix, prefix + length, device=query.device)[None].expand(len(members), length)
        out = invariant.attention(q, k, v, positions, scale)
        pieces.extend((s.start, out[i : i + 1]) for i, s in enumerate(members))
    pieces.sort(key=lambda item: item[0])
    row = pieces[0][1] if len(pieces) == 1 else torch.cat([o for _, o in pieces], dim=2)
    return row.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


_REGISTERED = False


def register_invariant_attention() -> str:
    """Register :func:`invariant_attention` (and a mask function that builds no mask) with transformers, once;
    returns the ``attn_implementation`` to load the actor with."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(INVARIANT_ATTENTION, invariant_attention)
        AttentionMaskInterface.register(INVARIANT_ATTENTION, _no_mask)
        _REGISTERED = True
    return INVARIANT_ATTENTION


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return invariant.linear(x, self.weight, self.bias)


def _norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return invariant.rms_norm(x, self.weight, self.variance_epsilon)


class InvariantSiLU(nn.Module):
    """The MLPs' activation: :func:`miles.engine.invariant.silu`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant.silu(x)


def install_invariant_forward(model: nn.Module) -> int:
    """Make ``model`` (loaded with ``attn_implementation = INVARIANT_ATTENTION``) compute with the batch-invariant
    ops: its linears, RMSNorms and SiLUs (before FSDP wraps it). Returns the number of modules changed."""
    count = 0
    for module in list(model.modules()):
        if type(module) is nn.Linear:
            module.forward = types.MethodType(_linear_forward, module)
            count += 1
        elif type(module).__name__ in _RMS_NORMS:
            module.forward = types.MethodType(_norm_forward, module)
            count += 1
        elif all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            module.act_fn = InvariantSiLU()
            count += 1
        elif hasattr(module, "experts") and hasattr(getattr(module, "gate", None), "top_k"):
            invariant.install_moe(module, router=False)  # the router: miles_fsdp.routing.patch_routers(invariant=)
            count += 1
    log.info("true on-policy: %d modules of the actor compute with the batch-invariant ops", count)
    return count
