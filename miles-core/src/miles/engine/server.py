"""The HTTP face of the local engine: SGLang's native endpoints over a :class:`Scheduler` (FastAPI).

Generation errors are HTTP 400 ``{"error": {"message": ...}}``; admin errors are HTTP 400
``{"success": false, "message": ...}`` (SGLang's shapes). With an API key every route but ``/health`` needs
``Authorization: Bearer <key>``; with an admin key the control routes need that one (:mod:`miles.auth`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from miles.engine.api_schema import describe_bodies
from miles.engine.faults import die_in_generate_if_asked
from miles.engine.parsing import RequestError
from miles.engine.protocol_app import create_protocol_app
from miles.engine.responses import generate_error, json_body
from miles.engine.state import EngineState

if TYPE_CHECKING:
    from miles.plugins.manager import PluginManager

__all__ = ["EngineState", "create_app"]

log = logging.getLogger(__name__)


def create_app(state: EngineState, *, plugins: PluginManager | None = None) -> FastAPI:
    """The FastAPI application serving ``state``: the protocol's shared routes
    (:func:`~miles.engine.protocol_app.create_protocol_app`), ``/generate``, and the route groups the plugins
    add (``miles_engine_routes``: the built-in weight, ``disk_delta`` and LoRA routes, miles-p2p's ...).

    :param plugins: the plugin manager whose route groups to add (default: a new one, loaded as the CLI's is).
    """
    from miles.plugins.manager import PluginManager

    app = create_protocol_app(state, title="miles local engine")
    sched = state.scheduler

    @app.post("/generate")
    async def generate(request: HTTPRequest) -> Any:
        die_in_generate_if_asked()
        try:
            call = state.start_generate(await json_body(request))
        except RequestError as exc:
            return generate_error(str(exc))
        batch, queues, reqs = call.batch, call.queues, call.requests
        state.generate_requests += 1
        state.generated_samples += len(reqs)
        if not batch.stream:
            try:
                results = []
                for q in queues:
                    while True:
                        payload, done = await q.get()
                        if done:
                            results.append(payload)
                            break
            except asyncio.CancelledError:  # client went away: free the engine
                for req in reqs:
                    sched.abort(req.rid)
                raise
            return results if batch.batched else results[0]

        async def events() -> AsyncIterator[bytes]:
            pending = set(range(len(queues)))
            try:
                while pending:
                    for i in sorted(pending):
                        payload, done = await queues[i].get()
                        if batch.batched:
                            payload["index"] = i
                        yield b"data: " + json.dumps(payload).encode() + b"\n\n"
                        if done:
                            pending.discard(i)
                yield b"data: [DONE]\n\n"
            finally:
                for i in pending:
                    sched.abort(reqs[i].rid)

        return StreamingResponse(events(), media_type="text/event-stream")

    (plugins if plugins is not None else PluginManager().load()).add_engine_routes(app=app, engine=state)
    describe_bodies(app, vocab_size=sched.runner.vocab_size, context_length=sched.context_length)
    return app
