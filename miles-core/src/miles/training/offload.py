"""Trainer memory moved off its device while colocated engines roll out, and back for training.

A colocated run shares each GPU between a trainer rank and an engine; the trainer's parameters, gradients,
optimizer state and reference model would otherwise stay on the GPU while the engine generates.
:class:`ParkedMemory` moves the *storages* under a set of tensors to host memory (pinned on CUDA) and shrinks
them to zero bytes on the device; :meth:`ParkedMemory.restore` re-allocates and copies them back. The tensor
objects stay what they were, so every reference to them — an optimizer's state, FSDP2's sharded parameters
and the views over them, a fused head — is valid again after the restore without being rebuilt. A parked tensor holds no bytes: nothing may read it
until it is restored (torch does not check; the colocation phases, :mod:`miles.driver.colocate`, bring the
trainer back before anything of it runs).

Why this and not ``torch-memory-saver`` (which SGLang's ``--enable-memory-saver`` uses for the engine): parking
storages needs no allocator hooked in with ``LD_PRELOAD``, keeps what was parked in host memory the run can
see and account for, and is the same code on a CPU, where CI runs it (there the host copy frees nothing:
there is no device memory to give back, so it runs only when asked, ``cluster.offload_trainer = true``).
``torch-memory-saver`` pauses without a copy (the virtual addresses stay, the physical pages go), so it is
faster where it is installed, but it drops the contents unless told to back them up, and works on CUDA only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ParkedMemory", "device_bytes", "storage_of"]

log = logging.getLogger(__name__)


def storage_of(tensor: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding ``tensor``'s values (a DTensor's local shard's, for FSDP2's parameters)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.untyped_storage()


def device_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the distinct storages under ``tensors`` hold now (a parked storage holds none)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        storage = storage_of(tensor)
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


@dataclass
class _Parked:
    storage: torch.UntypedStorage
    host: torch.Tensor
    """The storage's bytes (``uint8``), pinned when the storage is on CUDA."""


@dataclass
class ParkedMemory:
    """Storages moved to host memory, by the name of what they hold (``"state"``, ``"weights"`` ...)."""

    parked: dict[str, list[_Parked]] = field(default_factory=dict)

    @property
    def parked_bytes(self) -> int:
        return sum(p.host.numel() for group in self.parked.values() for p in group)

    def park(self, name: str, tensors: Iterable[torch.Tensor], *, device: str | None = None) -> int:
        """Move the distinct storages under ``tensors`` (those on ``device``'s type, ``"cuda"`` or ``"cpu"``,
        when given) to host memory and shrink them to zero bytes; return the bytes moved. Storages already parked (they hold no bytes) or empty are left as they are; a
        parameter memory-mapped from a file gets a storage of its own first (other tensors on one are left)."""
        import torch

        seen: set[int] = set()
        moved: list[_Parked] = []
        cuda = False
        for tensor in tensors:
            storage = storage_of(tensor)
            if storage.nbytes() and not storage.resizable() and isinstance(tensor, torch.nn.Parameter):
                tensor.data = tensor.data.clone()  # (memory-mapped from the model's safetensors: a copy of its own)
                storage = storage_of(tensor)
            if storage.nbytes() == 0 or not storage.resizable():
                continue
            if device is not None and storage.device.type != device:  # (a CPU-offloaded optimizer's state)
                continue
            key = storage.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            on_cuda = storage.device.type == "cuda"
            cuda = cuda or on_cuda
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=on_cuda)
            host.copy_(_bytes(storage), non_blocking=on_cuda)
            moved.append(_Parked(storage, host))
        if cuda:
            torch.cuda.synchronize()  # every copy landed before a storage goes
        for p in moved:
            p.storage.resize_(0)
        if cuda:
            torch.cuda.empty_cache()  # back to the device, not kept by the caching allocator
        self.parked.setdefault(name, []).extend(moved)
        return sum(p.host.numel() for p in moved)

    def restore(self, name: str | None = None) -> int:
        """Re-allocate the storages parked under ``name`` (every name when ``None``) on their device and copy
        their bytes back; return the bytes moved."""
        import torch

        total, cuda = 0, False
        for key in [name] if name is not None else list(self.parked):
            for p in self.parked.pop(key, []):
                p.storage.resize_(p.host.numel())
                on_cuda = p.storage.device.type == "cuda"
                cuda = cuda or on_cuda
                _bytes(p.storage).copy_(p.host, non_blocking=on_cuda)
                total += p.host.numel()
        if cuda:
            torch.cuda.synchronize()  # (the host buffers go now)
        return total

    def holds(self, name: str) -> bool:
        """Whether storages are parked under ``name``."""
        return bool(self.parked.get(name))


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A ``uint8`` tensor over every byte of ``storage``."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
