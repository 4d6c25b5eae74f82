"""How the trainer wraps each model: FSDP2 (:func:`miles_fsdp.model.shard_model`) over several ranks, the
plain module at world size 1.

One rank has nothing to shard, gather or reduce, yet ``fully_shard`` still turns every parameter into a
DTensor, copies each layer's parameters into an all-gather buffer before its forward and again before its
backward, runs a reduce-scatter per layer, and makes AdamW step parameter by parameter (no ``foreach`` over
DTensors): a large share of a small model's CPU step (see ``docs/benchmarks.md``, "Trainer step profile").
At world size 1 with float32 compute the FSDP mixed-precision policy is a no-op, so the plain module trains
the same weights; a lower-precision ``param_dtype`` keeps the FSDP wrapping, whose policy does the casts.
Checkpoints (DCP through ``get_state_dict``) and HF weights have the same names and values either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from miles_fsdp.model import enable_activation_checkpointing, shard_model

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["stays_plain", "wrap_model"]


def stays_plain(world_size: int, param_dtype: torch.dtype, *, wrap_single_rank: bool) -> bool:
    """Whether the trainer keeps a plain module: one rank, float32 compute, ``wrap_single_rank`` off."""
    return world_size == 1 and param_dtype == torch.float32 and not wrap_single_rank


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
