"""Weights out of a sharded model: bucket by bucket in Hugging Face naming, as a HF directory, and as
this rank's own shards.

Each parameter is gathered on its own (``DTensor.full_tensor``, a collective every rank joins); rank 0
keeps it until the bucket is full and hands the bucket over, so no rank ever holds more than one bucket
of full tensors besides its own shard. :func:`iter_weight_shards` gathers nothing: each rank's DTensor
shards with their place in the full tensor, for transports that send them straight to the engines.
"""

from __future__ import annotations

import json
import logging
import shutil
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from miles.training.trainer import WeightShard

__all__ = ["export_hf_dir", "hf_name", "iter_full_weights", "iter_weight_shards"]

log = logging.getLogger(__name__)

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


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
    from safetensors.torch import save_file

    out = Path(path)
    shards: list[tuple[str, list[str]]] = []
    total = 0
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)
    for bucket in iter_full_weights(model, bucket_bytes, rank=rank):
        if rank != 0:
            continue
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in bucket}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        file = f"shard-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        shards.append((file, list(tensors)))
    if rank != 0:
        return
    if len(shards) == 1:
        (out / shards[0][0]).rename(out / "model.safetensors")
    else:
        weight_map: dict[str, str] = {}
        for i, (file, names) in enumerate(shards):
            final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            (out / file).rename(out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    config.save_pretrained(out)  # type: ignore[attr-defined]
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out)
    if source_dir is not None and Path(source_dir).is_dir():
        for name in _TOKENIZER_FILES:
            src = Path(source_dir) / name
            if src.exists():
                shutil.copy2(src, out / name)
    log.info("exported a Hugging Face checkpoint to %s (%d shard(s), %.1f MB)", out, len(shards), total / 1e6)
