"""What both sides of a point-to-point push use: this machine's identity (the ``shm`` data path needs one
host) and a Mooncake Transfer Engine in this process (the ``mooncake`` data path: the engine registers its
receive buffer with one, each trainer rank writes through its own)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["MooncakeEndpoint", "host_id"]


def host_id() -> str:
    """This machine's identity (hostname and boot id): processes on one host share ``/dev/shm``."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}/{boot}"


class MooncakeEndpoint:
    """A Mooncake Transfer Engine in this process (P2P handshake, no metadata server).

    Mooncake's TCP listeners bind every interface whatever ``hostname`` says; ``hostname`` is the
    address it advertises to peers.
    """

    def __init__(self, hostname: str, *, protocol: str = "tcp", device_name: str = "") -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeError(
                "the mooncake data path needs the Mooncake Transfer Engine in this environment "
                "(pip install mooncake-transfer-engine-non-cuda, or the CUDA wheel mooncake-transfer-engine; "
                f"it needs the system library libibverbs1): {exc}"
            ) from None
        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(f"mooncake: initialize({hostname!r}, protocol {protocol!r}) failed with code {rc}")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self.registered: list[int] = []

    def register(self, tensor: torch.Tensor) -> int:
        """Register ``tensor``'s memory for transfers; returns its address."""
        address = int(tensor.data_ptr())
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            rc = self.engine.register_memory(address, nbytes)
            if rc != 0:
                raise RuntimeError(f"mooncake: register_memory of {nbytes} bytes failed with code {rc}")
            self.registered.append(address)
        return address

    def unregister_all(self) -> None:
        for address in self.registered:
            self.engine.unregister_memory(address)
        self.registered = []

    def write(self, target: str, sources: list[int], targets: list[int], lengths: list[int]) -> None:
        """Write local memory into ``target``'s registered memory (blocking); raises on failure."""
        if not sources:
            return
        rc = self.engine.batch_transfer_sync_write(target, sources, targets, lengths)
        if rc < 0:
            raise RuntimeError(f"mooncake: writing {sum(lengths)} bytes to {target} failed (code {rc})")
