"""Built-in weight transports: ``disk``, ``broadcast``, ``disk_delta`` and ``tensor_ipc``."""

from __future__ import annotations

from miles.components import Register
from miles.markers import hookimpl
from miles.transport.broadcast import BroadcastTransport
from miles.transport.colocated import TensorIpcTransport
from miles.transport.disk import DiskTransport
from miles.transport.disk_delta import DiskDeltaTransport


@hookimpl
def miles_register_transports(register: Register) -> None:
    register(DiskTransport)
    register(BroadcastTransport)
    register(DiskDeltaTransport)
    register(TensorIpcTransport)
