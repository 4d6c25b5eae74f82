"""Built-in weight transports: ``disk`` and ``broadcast``."""

from __future__ import annotations

from miles.components import Register
from miles.markers import hookimpl
from miles.transport.broadcast import BroadcastTransport
from miles.transport.disk import DiskTransport


@hookimpl
def miles_register_transports(register: Register) -> None:
    register(DiskTransport)
    register(BroadcastTransport)
