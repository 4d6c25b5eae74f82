"""Refuse a distributed checkpoint whose pickled files could run code, before Megatron reads them.

A ``megatron.core.dist_checkpointing`` directory holds three kinds of pickles besides the raw tensor
shards:

- ``.metadata``, written by ``torch.distributed.checkpoint`` and read back by its ``FileSystemReader``
  with a plain ``pickle.load`` (any global, so any code);
- ``common.pt`` (the non-sharded part of the state dict) and one ``<key>.pt`` per ``ShardedObject``,
  read by Megatron with ``torch.load(path)``: no ``weights_only`` argument, so torch's default applies
  (``True`` since torch 2.6, the restricted unpickler) unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` turns
  it off for the whole process.

:func:`check_checkpoint_files` reads each of them first with a restricted unpickler: ``.metadata`` may
name only the classes of torch's checkpoint metadata (and ``torch.Size`` / dtypes / layouts), the
``.pt`` files are loaded with ``weights_only=True`` explicitly. A checkpoint that needs anything else is
refused with the file and the global it names. Megatron then reads the same files; a file swapped
between the check and the load is outside what this guards (load from directories you control).
"""

from __future__ import annotations

import importlib
import os
import pickle
from pathlib import Path
from typing import Any

__all__ = ["UnsafeCheckpointError", "check_checkpoint_files"]

_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)
_FORCE_UNSAFE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks the unpickler for something outside the allowed set."""


class _MetadataUnpickler(pickle.Unpickler):
    """Only the data classes and enums of torch's checkpoint metadata, ``torch.Size``, dtypes, layouts,
    paths (a checkpoint id) and ``OrderedDict``."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module in _DCP_MODULES:
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) or name == "_MEM_FORMAT_ENCODING":
                return found
        if module == "torch":
            found = getattr(torch, name, None)
            if found is torch.Size or isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            import pathlib  # a checkpoint id saved as a path (constructing one runs nothing)

            return getattr(pathlib, name)
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        raise UnsafeCheckpointError(
            f"{self.path}: refusing to load the checkpoint: its pickle names {module}.{name}, which is not "
            "part of torch's checkpoint metadata"
        )


def check_checkpoint_files(path: str | os.PathLike[str]) -> None:
    """Read every pickle of the checkpoint at ``path`` with a restricted unpickler; raise
    :class:`UnsafeCheckpointError` (a ``ValueError``) naming the file when one needs more."""
    import torch

    root = Path(path)
    if os.environ.get(_FORCE_UNSAFE, "0").lower() in ("1", "y", "yes", "true"):
        raise UnsafeCheckpointError(
            f"{_FORCE_UNSAFE} is set: Megatron would unpickle {root}/common.pt with arbitrary code; unset it"
        )
    metadata = root / ".metadata"
    if metadata.exists():
        with open(metadata, "rb") as f:
            _MetadataUnpickler(f, metadata).load()
    for file in sorted(root.rglob("*.pt")):
        try:
            torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0]
            raise UnsafeCheckpointError(f"{file}: refusing to load the checkpoint: {first}") from None
