"""Engine side of distributed weight updates and of weight verification.

- SGLang's ``/init_weights_update_group``, ``/update_weights_from_distributed`` and
  ``/destroy_weights_update_group``: the engine joins a process group with the trainer (rank
  ``rank_offset``) and receives broadcast tensors into its parameters, by Hugging Face name.
- ``/weights_checksum`` (a Miles endpoint): an XXH3-128 checksum per parameter of what the engine serves, plus the
  names that alias another parameter (tied embeddings), so the driver can prove every tensor was updated.
- SGLang's ``/get_weights_by_name {name, truncate_size}``: the first ``truncate_size`` rows of a parameter
  (by HF name; a tied alias answers with its owner) as float32 lists, as SGLang answers it — what the
  driver samples to verify engines that have no checksum route.
- ``/debug/randomize_weights`` (only with ``--enable-debug-endpoints``): overwrite every parameter with
  random values, so a test can show a push really overwrote all of them.

All functions run on the engine's scheduler thread, between forward passes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from miles.engine.weights import parameter_aliases, served_parameters, weights_checksum
from miles.transport.broadcast import broadcast_tensors, make_process_group

__all__ = ["WeightGroups", "load_named_tensors", "parameter_aliases", "weights_by_name", "weights_checksum"]

log = logging.getLogger(__name__)


def load_named_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Copy ``tensors`` into the model's parameters by HF name; unknown names or shapes are errors."""
    params = served_parameters(model)
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise ValueError(
            f"the model has no parameter {unknown[0]!r}"
            + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
        )
    with torch.no_grad():
        for name, tensor in tensors.items():
            target = params[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"parameter {name!r} has shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
    return len(tensors)


def weights_by_name(model: torch.nn.Module, name: str, truncate_size: int = 100) -> list[Any]:
    """SGLang's ``/get_weights_by_name``: ``param.float().tolist()[:truncate_size]`` (rows of a matrix,
    values of a vector). An unknown name is a ``ValueError``."""
    params = served_parameters(model)
    if name not in params:
        raise ValueError(f"the model has no parameter {name!r}")
    if truncate_size < 1:
        raise ValueError(f"truncate_size must be >= 1, got {truncate_size}")
    rows: list[Any] = params[name].detach()[:truncate_size].to(device="cpu", dtype=torch.float32).tolist()
    return rows


def randomize_weights(model: torch.nn.Module, seed: int) -> int:
    """Overwrite every parameter with random values (debug endpoint); returns how many."""
    generator = torch.Generator().manual_seed(seed)
    count = 0
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.dtype))
            count += 1
    return count


@dataclass
class _Group:
    group: Any
    store: Any
    rank: int
    world_size: int
    device: torch.device


class WeightGroups:
    """The process groups an engine joined for weight updates, by name."""

    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}

    def init(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        device: torch.device,
        timeout: float = 600.0,
    ) -> None:
        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} already exists")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: {backend!r} is not supported (gloo or nccl)")
        group, store = make_process_group(
            backend,
            host=master_address,
            port=int(master_port),
            rank=int(rank_offset),
            world_size=int(world_size),
            timeout=timeout,
            is_master=False,
            group_name=group_name,
        )
        self.groups[group_name] = _Group(group, store, int(rank_offset), int(world_size), device)
        # (the group's name may hold the run's secret: not logged)
        log.info("joined a weight update group as rank %d of %d (%s)", rank_offset, world_size, backend)

    def receive(
        self, model: torch.nn.Module, *, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> int:
        """Receive one bucket (broadcast from rank 0, in ``names`` order) and load it."""
        entry = self.groups.get(group_name)
        if entry is None:
            raise ValueError(f"no weight update group {group_name!r} (call /init_weights_update_group first)")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        params = served_parameters(model)
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"the model has no parameter {missing[0]!r}")
        received = {}
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=entry.device)
            broadcast_tensors(entry.group, [buffer])
            received[name] = buffer
        return load_named_tensors(model, received)

    def destroy(self, group_name: str) -> None:
        entry = self.groups.pop(group_name, None)
        if entry is None:
            raise ValueError(f"no weight update group {group_name!r}")


class MemoryOccupation:
    """SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation`` for colocated training.

    ``kv_cache``: running requests are retracted (recomputed after resume), the prefix cache is flushed
    and the KV buffers are freed. ``weights``: every parameter storage is shrunk to zero bytes (the
    tensors and the fused views over them stay valid objects); resume re-allocates them zero-filled, and
    the next weight push fills them (weight verification then proves every tensor arrived).
    Generation stays paused from release until ``/continue_generation``.
    """

    TAGS = ("kv_cache", "weights")

    def __init__(self) -> None:
        self.released_weights: list[tuple[torch.UntypedStorage, int]] = []
        self.kv_released = False

    def _tags(self, tags: list[str] | None) -> list[str]:
        tags = list(self.TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in self.TAGS]
        if unknown:
            raise ValueError(f"tags: unknown tag {unknown[0]!r} (expected {', '.join(self.TAGS)})")
        return tags

    def release(self, scheduler: Any, tags: list[str] | None) -> dict[str, float]:
        tags = self._tags(tags)
        runner = scheduler.runner
        if scheduler.paused is None:
            scheduler.pause("retract")
        freed = 0
        if "kv_cache" in tags and not self.kv_released:
            scheduler.flush_cache()
            freed += runner.free_buffers()
            self.kv_released = True
        if "weights" in tags and not self.released_weights:
            runner.drop_packed()
            seen: set[int] = set()
            for p in runner.model.parameters():
                if not p.untyped_storage().resizable():  # e.g. memory-mapped from safetensors
                    p.data = p.data.clone()
                storage = p.untyped_storage()
                if id(storage) in seen or storage.nbytes() == 0:
                    continue
                seen.add(id(storage))
                self.released_weights.append((storage, storage.nbytes()))
                freed += storage.nbytes()
                storage.resize_(0)
        if freed and torch.cuda.is_available() and runner.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the device (the caching allocator would keep it)
        log.info("released %s (%.1f MB)", ", ".join(tags), freed / 1e6)
        return {"freed_bytes": float(freed)}

    def resume(self, scheduler: Any, tags: list[str] | None) -> None:
        tags = self._tags(tags)
        if "weights" in tags:
            for storage, nbytes in self.released_weights:
                storage.resize_(nbytes)
                torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()
            self.released_weights = []
        if "kv_cache" in tags:
            self.kv_released = False  # the runner grows its KV buffers again on demand
        log.info("resumed %s (generation stays paused until /continue_generation)", ", ".join(tags))
