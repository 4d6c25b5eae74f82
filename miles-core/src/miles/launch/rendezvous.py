"""Rendezvous for ``torch.distributed``: the per-rank environment of trainer processes and the store the
launcher hosts for them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from miles.launch.base import ProcessSpec

__all__ = ["RendezvousStore", "trainer_specs"]


def trainer_specs(
    argv: Sequence[str],
    world_size: int,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    devices: Sequence[Sequence[int]] | None = None,
    cwd: str | None = None,
    name: str = "trainer",
) -> list[ProcessSpec]:
    """One :class:`ProcessSpec` per rank of a single-host ``torch.distributed`` job (``env://`` init).

    Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, as ``torchrun`` sets
    them, and ``MASTER_ADDR`` / ``MASTER_PORT`` when ``master_port`` is given (otherwise the launcher hosts
    the rendezvous store and sets them: :meth:`~miles.launch.base.Launcher.start_trainers`).

    :param devices: per rank, the accelerator indices it may see (``CUDA_VISIBLE_DEVICES``); ``None``
        leaves the variable alone (CPU, or ranks that pick ``cuda:LOCAL_RANK`` themselves).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if devices is not None and len(devices) != world_size:
        raise ValueError(f"devices lists {len(devices)} ranks, world_size is {world_size}")
    specs = []
    for rank in range(world_size):
        rank_env = dict(env or {})
        if master_port is not None:
            rank_env.update(MASTER_ADDR=master_addr or "127.0.0.1", MASTER_PORT=str(master_port))
        rank_env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        if devices is not None:
            rank_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices[rank])
        specs.append(ProcessSpec(name=f"{name}-{rank}", argv=list(argv), env=rank_env, cwd=cwd))
    return specs


class RendezvousStore:
    """The trainer ranks' ``torch.distributed`` store, hosted by the launching side on ``host`` (a port the OS
    picks as it binds: no other process can take it between choosing and binding) for as long as this object
    lives; the ranks join it as clients, as ``torchrun``'s agent store."""

    def __init__(self, host: str = "127.0.0.1", *, timeout: float = 600.0) -> None:
        from miles.net import host_store

        self.host = host
        self.store: Any
        self.store, self.port = host_store(host, timeout=timeout)

    def env(self) -> dict[str, str]:
        """What each rank's environment needs to join (``env://``)."""
        return {
            "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }

    def join(self, specs: Sequence[ProcessSpec]) -> None:
        """Point every rank of ``specs`` at this store (ranks that name their own ``MASTER_PORT`` keep it)."""
        for spec in specs:
            if "MASTER_PORT" not in spec.env:
                spec.env.update(self.env())
