"""The ``p2p`` plugin: registers :class:`miles_p2p.transport.P2PTransport` as transport ``p2p``, and adds
the receiving side, the ``/p2p/*`` routes (:mod:`miles_p2p.routes`), to every local engine.

The transport module imports only the core interfaces and pydantic at module level (torch, the data
paths and Mooncake are imported when a session opens), so listing plugins stays cheap; the routes are
imported in the engine's process only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import miles

if TYPE_CHECKING:
    from fastapi import FastAPI

    from miles.components import Register


@miles.hookimpl
def miles_register_transports(register: Register) -> None:
    from miles_p2p.transport import P2PTransport

    register(P2PTransport)


@miles.hookimpl
def miles_engine_routes(app: FastAPI, engine: object) -> None:
    from miles.engine.state import EngineState

    if not isinstance(engine, EngineState):  # the local engine's only (its scheduler and torch model)
        return
    from miles_p2p.routes import add_p2p_routes

    add_p2p_routes(app, engine)
