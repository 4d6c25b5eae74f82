"""Full weights out of a sharded model: bucket by bucket in Hugging Face naming, and as a HF directory.

Each parameter is gathered on its own (``DTensor.full_tensor``, a collective every rank joins); rank 0
keeps it until the bucket is full and hands the bucket over, so no rank ever holds more than one bucket
of full tensors besides its own shard.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from miles.training.hf_export import write_hf_checkpoint

__all__ = ["export_hf_dir", "hf_name", "iter_full_weights"]

log = logging.getLogger(__name__)

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    """A parameter's Hugging Face name: wrapper prefixes (activation checkpointing, compile) removed."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def iter_full_weights(model: nn.Module, bucket_bytes: int, *, rank: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets of ``(hf_name, full tensor)`` of ``model``'s parameters (tied ones once).

    A collective: every rank iterates and yields the same number of buckets; only rank 0's are filled.
    A bucket closes once it reaches ``bucket_bytes`` (a parameter larger than that is a bucket alone).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    count = 0
    for name, param in model.named_parameters():
        data = param.detach()
        full_tensor = getattr(data, "full_tensor", None)
        full = full_tensor() if full_tensor is not None else data
        count += 1
        size += full.numel() * full.element_size()
        if rank == 0:
            bucket.append((hf_name(name), full))
        del full
        if size >= bucket_bytes:
            yield bucket
            bucket, size, count = [], 0, 0
    if count:
        yield bucket


def export_hf_dir(
    model: nn.Module, config: object, path: str, *, rank: int, bucket_bytes: int, source_dir: str | None
) -> None:
    """Write a HF safetensors directory (``config.json``, weights in shards of about ``bucket_bytes``,
    ``model.safetensors.index.json`` when there are several, tokenizer files copied from ``source_dir``).

    A collective: every rank calls; rank 0 writes.
    """
    write_hf_checkpoint(
        iter_full_weights(model, bucket_bytes, rank=rank),
        path,
        rank=rank,
        config=config,
        source_dir=source_dir,
        generation_config=getattr(model, "generation_config", None),
    )
