"""How the trainer wraps each model: FSDP2 (:func:`miles_fsdp.model.shard_model`) over several ranks, the
plain module at world size 1.

One rank has nothing to shard, gather or reduce, yet ``fully_shard`` still turns every parameter into a
DTensor, copies each layer's parameters into an all-gather buffer before its forward and again before its
backward, runs a reduce-scatter per layer, and makes AdamW step parameter by parameter (no ``foreach`` over
DTensors): a large share of a small model's CPU step (see ``docs/benchmarks.md``, "Trainer step profile").
At world size 1 with float32 compute the FSDP mixed-precision policy is a no-op, so the plain module trains
the same weights; with a lower-precision ``param_dtype`` the plain module's forwards run under ``torch.autocast``
(:func:`forward_precision`) instead of FSDP's all-gather casts.
Checkpoints (DCP through ``get_state_dict``) and HF weights have the same names and values either way.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from miles_fsdp.model import enable_activation_checkpointing, shard_model

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["forward_precision", "stays_plain", "wrap_model"]


def stays_plain(world_size: int, param_dtype: torch.dtype, *, wrap_single_rank: bool, true_on_policy: bool) -> bool:
    """Whether the trainer keeps a plain module: one rank and ``wrap_single_rank`` off; with a lower-precision
    ``param_dtype`` also not ``train.true_on_policy`` (whose gradients keep FSDP's bf16 forward)."""
    if world_size != 1 or wrap_single_rank:
        return False
    return param_dtype == torch.float32 or not true_on_policy


def forward_precision(plain: bool, param_dtype: torch.dtype, device: torch.device) -> AbstractContextManager[Any]:
    """The context of every forward: a plain module with a lower-precision ``param_dtype`` computes under
    ``torch.autocast`` (float32 master weights, gradients and AdamW state; the GEMMs and attention in
    ``param_dtype``; norms, softmax and the residual stream in float32); otherwise nothing (FSDP's policy casts)."""
    if plain and param_dtype != torch.float32:
        return torch.autocast(device.type, dtype=param_dtype)
    return nullcontext()


def wrap_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    plain: bool,
    device: torch.device,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool,
    activation_checkpointing: bool,
) -> nn.Module:
    """``model`` itself on ``device`` when ``plain`` (:func:`stays_plain`), else FSDP2-sharded over ``mesh``."""
    if not plain:
        return shard_model(
            model,
            mesh,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard_after_forward,
            cpu_offload=cpu_offload,
            activation_checkpointing=activation_checkpointing,
        )
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    return model.to(device)
