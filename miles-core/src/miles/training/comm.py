"""The collectives the driver and the trainers need between trainer ranks — tensors as tensors, small control values as
JSON bytes (never pickles). Tensors travel on the process group's device (CUDA for NCCL) and come back
on the CPU."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "all_gather_json",
    "all_gather_rows",
    "all_gather_tensors",
    "all_reduce_sum",
    "broadcast_json",
    "broadcast_tensors",
]

_DTYPES = ("float32", "float64", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over every rank, in place (returned; unchanged without a process group). The tensor
    must be on the process group's device."""
    import torch.distributed as dist

    if _distributed():
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def broadcast_json(value: Any, *, src: int = 0) -> Any:
    """Rank ``src``'s JSON-serialisable ``value`` on every rank (identity without a process group)."""
    import torch
    import torch.distributed as dist

    if not _distributed():
        return value
    device = _device()
    if dist.get_rank() == src:
        payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    if dist.get_rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src)
    return json.loads(payload.cpu().numpy().tobytes().decode())


def all_gather_json(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    import torch
    import torch.distributed as dist

    if not _distributed():
        return [value]
    device = _device()
    world = dist.get_world_size()
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [
        json.loads(g[: int(s.item())].cpu().numpy().tobytes().decode()) for g, s in zip(gathered, sizes, strict=True)
    ]


def broadcast_tensors(tensors: Mapping[str, torch.Tensor] | None, *, src: int = 0) -> dict[str, torch.Tensor]:
    """Rank ``src``'s named tensors on every rank (``tensors`` is ignored on the others): the names,
    dtypes and shapes go as one JSON header, then each tensor as itself."""
    import torch
    import torch.distributed as dist

    if not _distributed():
        assert tensors is not None, "broadcast_tensors: the source rank must pass its tensors"
        return dict(tensors)
    is_src = dist.get_rank() == src
    header = None
    if is_src:
        assert tensors is not None, "broadcast_tensors: the source rank must pass its tensors"
        header = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]
    device = _device()
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in broadcast_json(header, src=src):
        if dtype not in _DTYPES:
            raise ValueError(f"broadcast_tensors: tensor {name!r} has an unsupported dtype {dtype}")
        if is_src:
            assert tensors is not None
            buffer = tensors[name].detach().contiguous().to(device)
        else:
            buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        # gloo has no 16-bit integers (the routed experts are int16): those travel as their bytes
        dist.broadcast(buffer.view(torch.uint8) if dtype == "int16" else buffer, src)
        out[name] = tensors[name] if is_src and tensors is not None else buffer.cpu()
    return out


def all_gather_rows(local: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The 1-D tensors of every rank concatenated in rank order; rank ``r`` holds ``sizes[r]`` values
    (every rank knows the sizes: no size exchange)."""
    import torch
    import torch.distributed as dist

    if not _distributed():
        return local
    device = _device()
    longest = max(sizes) if sizes else 0
    padded = torch.zeros(longest, dtype=local.dtype, device=device)
    padded[: local.numel()] = local.to(device)
    gathered = [torch.zeros(longest, dtype=local.dtype, device=device) for _ in sizes]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:n].cpu() for g, n in zip(gathered, sizes, strict=True)])


def all_gather_tensors(tensors: Mapping[str, torch.Tensor], *, group: Any = None) -> list[dict[str, torch.Tensor]]:
    """Every rank's named tensors (the same names on every rank, any shapes), in rank order within
    ``group`` (default: the whole world). Shapes go as JSON, the data as padded flat tensors."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [dict(tensors)]
    device = _device()
    world = dist.get_world_size(group)
    names = sorted(tensors)
    local_shapes = [list(tensors[n].shape) for n in names]
    header = torch.frombuffer(bytearray(json.dumps(local_shapes).encode()), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([header.numel()], dtype=torch.int64, device=device), group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: header.numel()] = header
    gathered = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    shapes = [
        json.loads(g[: int(s.item())].cpu().numpy().tobytes().decode()) for g, s in zip(gathered, sizes, strict=True)
    ]
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for j, name in enumerate(names):
        # as raw bytes: exact for every dtype, and gloo has no all_gather for some (int16, bool)
        local = tensors[name].detach().contiguous()
        width = local.element_size()
        counts = [int(torch.Size(rank_shapes[j]).numel()) * width for rank_shapes in shapes]
        buf = torch.zeros(max(counts), dtype=torch.uint8, device=device)
        buf[: local.numel() * width] = local.reshape(-1).view(torch.uint8).to(device)
        parts = [torch.zeros(max(counts), dtype=torch.uint8, device=device) for _ in range(world)]
        dist.all_gather(parts, buf, group=group)
        for r in range(world):
            out[r][name] = parts[r][: counts[r]].cpu().view(local.dtype).reshape(shapes[r][j])
    return out
