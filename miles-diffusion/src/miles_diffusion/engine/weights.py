"""The image engine's weights: loading a pushed version from disk, checksums for verification, and the
test mode that overwrites them with random values. All run on the scheduler's worker thread.

A pushed version is a directory of safetensors shards (the ``disk`` transport writes
``model-NNNNN.safetensors`` and an index) holding the transformer's parameters under their diffusers
names; a push must name every parameter exactly (strict), or nothing is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["load_weights_from_disk", "randomize_weights", "weights_checksum"]


def _shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no safetensors files")
    return files


def load_weights_from_disk(transformer: Any, path: str) -> int:
    """Copy every parameter of the directory ``path`` into ``transformer`` (cast to its dtype); returns
    how many. Raises ``ValueError`` naming a missing, unknown or misshapen tensor before changing anything."""
    import torch
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model_path {path!r} is not a directory")
    tensors: dict[str, torch.Tensor] = {}
    for file in _shard_files(folder):
        tensors.update(load_file(str(file)))
    params = dict(transformer.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unknown = sorted(set(tensors) - set(params))
    if missing or unknown:
        raise ValueError(
            f"{path}: the weights do not match the transformer: missing {missing[:3]}, unknown {unknown[:3]}"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor.to(dtype=params[name].dtype))
    return len(tensors)


def weights_checksum(transformer: Any) -> dict[str, Any]:
    """``{"dtype", "checksums": {name: xxh3-128 hex}}`` of the served parameters (:func:`miles.transport.verify.tensor_checksum`)."""
    from miles.transport.verify import tensor_checksum

    checksums = {name: tensor_checksum(p) for name, p in transformer.named_parameters()}
    dtype = str(next(iter(transformer.parameters())).dtype).removeprefix("torch.")
    return {"dtype": dtype, "checksums": checksums}


def randomize_weights(transformer: Any, seed: int) -> int:
    """Overwrite every parameter with seeded random values (proves a push really sent each tensor)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for p in transformer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype) * 0.02)
            count += 1
    return count
