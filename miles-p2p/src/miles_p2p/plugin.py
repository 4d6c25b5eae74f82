"""The ``p2p`` plugin: registers :class:`miles_p2p.transport.P2PTransport` as transport ``p2p``.

The transport module imports only the core interfaces and pydantic at module level (torch, the data
paths and Mooncake are imported when a session opens), so listing plugins stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import miles

if TYPE_CHECKING:
    from miles.components import Register


@miles.hookimpl
def miles_register_transports(register: Register) -> None:
    from miles_p2p.transport import P2PTransport

    register(P2PTransport)
