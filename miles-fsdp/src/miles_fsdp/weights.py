"""Weights out of a sharded model: bucket by bucket in Hugging Face naming, as a HF directory, and as
this rank's own shards.

Each parameter is gathered on its own (``DTensor.full_tensor``, a collective every rank joins); rank 0
keeps it until the bucket is full and hands the bucket over, so no rank ever holds more than one bucket
of full tensors besides its own shard. :func:`iter_weight_shards` gathers nothing: each rank's DTensor
shards with their place in the full tensor, for transports that send them straight to the engines.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from miles.training.hf_export import write_hf_checkpoint

if TYPE_CHECKING:
    from miles.training.adapter import ModelAdapter
    from miles.training.trainer import WeightShard

__all__ = ["export_adapted", "export_hf_dir", "hf_name", "iter_full_weights", "iter_weight_shards"]

log = logging.getLogger(__name__)

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    """A parameter's Hugging Face name: wrapper prefixes (activation checkpointing, compile) removed."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def iter_full_weights(
    model: nn.Module,
    bucket_bytes: int,
    *,
    rank: int,
    rename: Callable[[str], str | None] | None = None,
    every_rank: bool = False,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets of ``(hf_name, full tensor)`` of ``model``'s parameters (tied ones once).

    ``rename`` (a model adapter's ``adapter_name``) selects and names the parameters: those it maps to
    ``None`` are skipped without being gathered.

    A collective: every rank iterates and yields the same number of buckets; only rank 0's are filled, or
    every rank's with ``every_rank`` (the gather gives each rank the full tensor; it is then kept).
    A bucket closes once it reaches ``bucket_bytes`` (a parameter larger than that is a bucket alone).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    count = 0
    for name, param in model.named_parameters():
        out_name = hf_name(name) if rename is None else rename(hf_name(name))
        if out_name is None:
            continue
        data = param.detach()
        full_tensor = getattr(data, "full_tensor", None)
        full = full_tensor() if full_tensor is not None else data
        count += 1
        size += full.numel() * full.element_size()
        if rank == 0 or every_rank:
            bucket.append((out_name, full))
        del full
        if size >= bucket_bytes:
            yield bucket
            bucket, size, count = [], 0, 0
    if count:
        yield bucket


_PLACES = "_miles_weight_places"
"""Attribute of the model caching, per parameter name, the parameter (weakly), its HF name, full shape
and shard offsets: stable for a parameter's life, and DTensor's placement arithmetic costs more than
the push of a small model."""


def iter_weight_shards(model: nn.Module) -> Iterator[WeightShard]:
    """This rank's part of each parameter of ``model`` (tied ones once), with its offsets in the full tensor.

    A DTensor parameter gives its local shard (FSDP2's ``Shard(0)``: a block of rows, empty on ranks
    past the last row); a plain parameter is held whole by every rank (a replica). Not a collective.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from miles.training.trainer import WeightShard

    cache: dict[str, tuple[weakref.ref[nn.Parameter], tuple[str, tuple[int, ...], tuple[int, ...]]]]
    cache = model.__dict__.setdefault(_PLACES, {})
    with torch.no_grad():
        for name, param in model.named_parameters():
            entry = cache.get(name)
            place = entry[1] if entry is not None and entry[0]() is param else None
            sharded = isinstance(param, DTensor) or isinstance(param.data, DTensor)
            local = param.to_local() if sharded else param.detach()
            if place is None:
                if sharded:
                    shape, offsets = compute_local_shape_and_global_offset(
                        param.shape, param.device_mesh, param.placements
                    )
                    if tuple(local.shape) != tuple(shape):
                        raise RuntimeError(
                            f"{name}: local shard {tuple(local.shape)} differs from its placement {shape}"
                        )
                else:
                    offsets = (0,) * param.dim()
                place = (hf_name(name), tuple(param.shape), tuple(int(o) for o in offsets))
                cache[name] = (weakref.ref(param), place)
            yield WeightShard(place[0], place[1], place[2], local.detach())


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


def _rebucket(pairs: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in pairs:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    yield bucket


def export_adapted(
    model: nn.Module,
    adapter: ModelAdapter[Any],
    config: object,
    path: str,
    *,
    rank: int,
    bucket_bytes: int,
    source_dir: str | None,
) -> None:
    """A model trained with ``adapter``: the merged model as a HF directory at ``path`` (as
    :func:`export_hf_dir` writes it) and the adapter alone in ``path/adapter`` (``adapter_model.safetensors``
    and ``adapter_config.json``, PEFT's format). A collective: every rank calls; rank 0 writes."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    full = (pair for bucket in iter_full_weights(model, bucket_bytes, rank=rank) for pair in bucket)
    write_hf_checkpoint(
        _rebucket(adapter.merged(full), bucket_bytes),
        path,
        rank=rank,
        config=config,
        source_dir=source_dir,
        generation_config=getattr(model, "generation_config", None),
    )
    tensors = [
        pair
        for bucket in iter_full_weights(model, bucket_bytes, rank=rank, rename=adapter.adapter_name)
        for pair in bucket
    ]
    if rank == 0:
        out = Path(path) / "adapter"
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {n: t.detach().cpu().contiguous() for n, t in tensors},
            str(out / "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        adapter_config = {**adapter.adapter_config(), "base_model_name_or_path": source_dir}
        (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
