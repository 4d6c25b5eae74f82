"""Rendezvous for ``torch.distributed``: free ports and the per-rank environment of trainer processes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from miles.launch.base import ProcessSpec
from miles.launch.ports import free_port

__all__ = ["free_port", "trainer_specs"]


def trainer_specs(
    argv: Sequence[str],
    world_size: int,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    devices: Sequence[Sequence[int]] | None = None,
    cwd: str | None = None,
    name: str = "trainer",
) -> list[ProcessSpec]:
    """One :class:`ProcessSpec` per rank of a single-host ``torch.distributed`` job (``env://`` init).

    Each rank gets ``MASTER_ADDR``, ``MASTER_PORT`` (a free port unless given), ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, as ``torchrun`` sets them.

    :param devices: per rank, the accelerator indices it may see (``CUDA_VISIBLE_DEVICES``); ``None``
        leaves the variable alone (CPU, or ranks that pick ``cuda:LOCAL_RANK`` themselves).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if devices is not None and len(devices) != world_size:
        raise ValueError(f"devices lists {len(devices)} ranks, world_size is {world_size}")
    port = master_port if master_port is not None else free_port(master_addr)
    specs = []
    for rank in range(world_size):
        rank_env = dict(env or {})
        rank_env.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        if devices is not None:
            rank_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices[rank])
        specs.append(ProcessSpec(name=f"{name}-{rank}", argv=list(argv), env=rank_env, cwd=cwd))
    return specs
