"""Settings of the ``p2p`` transport (``[transport] name = "p2p"`` and these keys)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles.components import ComponentSettings

__all__ = ["P2PTransportSettings"]


class P2PTransportSettings(ComponentSettings):
    """Settings of the ``p2p`` transport."""

    datapath: Literal["torch", "mooncake", "shm"] = "torch"
    """How chunks move: ``torch`` (``torch.distributed`` point-to-point sends: gloo on CPU, NCCL on GPU),
    ``mooncake`` (the Mooncake Transfer Engine: TCP, or RDMA with ``mooncake_protocol = "rdma"``), or
    ``shm`` (shared memory: trainer ranks and engines on one host)."""
    address: str | None = None
    """This process's address as the others reach it: trainer rank 0's is the ``torch`` group's store, each
    rank's own is what Mooncake advertises to the engines. Unset: the process's node address as its launcher
    tells it (``MILES_NODE_ADDRESS``: the ``ray`` launcher gives every process its node's IP), else
    ``127.0.0.1`` (the ``local`` launcher: one host). ``MILES_P2P_ADDRESS`` overrides both per process (a
    node with several networks: the one the engines reach)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the ``torch`` group's store (0: one the OS picks as trainer rank 0 binds it)."""
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    """Mooncake's transport protocol."""
    mooncake_device: str = ""
    """Mooncake's RDMA device names (comma-separated; empty: all it finds)."""
    write_into_weights: bool = False
    """``shm`` only: the trainer ranks write straight into the engines' weights (each engine moves them to
    shared memory once and pauses generation for the push) — one copy instead of two (the zero-copy
    same-host path, as CUDA IPC is on a GPU). The price: a push that fails midway leaves those engines
    paused on partial weights instead of serving their previous version."""
    timeout: float = Field(600.0, gt=0)
    """Seconds the group's collectives, an engine's receive, or a rendezvous may take."""
    verify_slices: bool = True
    """After each push, compare a checksum of every chunk each engine serves with the sending rank's; the
    per-tensor checksums the driver verifies come from this check (turn both off together:
    ``transport.verify = false``)."""
