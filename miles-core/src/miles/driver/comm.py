"""Small collectives the driver needs between trainer ranks: JSON values as byte tensors (no pickles)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["all_gather_json", "broadcast_json"]


def broadcast_json(value: Any, *, src: int = 0) -> Any:
    """Rank ``src``'s JSON-serialisable ``value`` on every rank (identity without a process group)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    if dist.get_rank() == src:
        payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src)
    if dist.get_rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src)
    return json.loads(payload.numpy().tobytes().decode())


def all_gather_json(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    world = dist.get_world_size()
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [json.loads(g[: int(s.item())].numpy().tobytes().decode()) for g, s in zip(gathered, sizes, strict=True)]
