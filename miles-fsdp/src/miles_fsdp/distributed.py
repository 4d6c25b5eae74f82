"""Start and stop the ``torch.distributed`` world of trainer ranks (gloo on CPU, NCCL on GPU).

The core's launcher starts the processes; these helpers are what each rank calls first and last.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from miles.errors import SettingsError
from miles.training.trainer import DistContext

__all__ = ["init_distributed", "shutdown_distributed"]

log = logging.getLogger(__name__)


def init_distributed(
    rank: int,
    world_size: int,
    *,
    device: str = "cpu",
    local_rank: int | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    timeout_s: float = 600.0,
) -> DistContext:
    """Initialise the default process group (``env://`` when ``master_port`` is ``None``).

    ``device="cuda"`` selects NCCL and binds this rank to GPU ``local_rank``; ``cpu`` selects gloo.
    """
    if device not in ("cpu", "cuda"):
        raise SettingsError(f"cluster.device: expected 'cpu' or 'cuda', got {device!r}")
    local = rank if local_rank is None else local_rank
    if master_port is not None:
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs: dict[str, object] = {}
    if device == "cuda":
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), **kwargs)
    log.debug("rank %d/%d joined the %s process group", rank, world_size, backend)
    return DistContext(rank=rank, world_size=world_size, local_rank=local, device=device)


def shutdown_distributed() -> None:
    """Barrier, then destroy the process group (without the barrier, gloo teardown aborts now and then)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
