"""Weights into the served model by Hugging Face name: from safetensors files or from tensors in memory, every
tensor checked (name, shape) before any is copied (:meth:`miles.engine.model_runner.ModelRunner.load_weights`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles.engine.multimodal import module_name

__all__ = ["copy_in", "safetensors_tensors"]


def safetensors_tensors(model_path: str | Path) -> list[tuple[str, str, torch.Tensor]]:
    """``(file, HF name, tensor)`` of every tensor of the safetensors files in ``model_path`` (a directory or one
    file): views of the files' memory maps, so each tensor is copied once, page cache -> parameter."""
    from miles.transport.files import map_safetensors

    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.exists() for f in files):
        raise ValueError(f"{path}: no .safetensors files found")
    return [(str(file), name, tensor) for file in files for name, tensor in map_safetensors(file).items()]


def copy_in(model: Any, named: list[tuple[str, str, torch.Tensor]], *, vision: bool) -> int:
    """Check every ``(source, name, tensor)`` against ``model``'s parameters, then copy them all in (casting);
    returns how many. Raises ``ValueError`` naming the source and the tensor before any weight is changed."""
    params = dict(model.state_dict(keep_vars=True))  # includes tied aliases (lm_head.weight)
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for where, name, tensor in named:
        target = params.get(name)
        if target is None and vision:  # a checkpoint in transformers' saved layout
            target = params.get(module_name(name))
        if target is None:
            raise ValueError(f"{where}: tensor {name!r} is not a parameter of the served model")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        staged.append((target, tensor))
    for target, tensor in staged:
        target.copy_(tensor.to(dtype=target.dtype, device=target.device))
    return len(staged)
