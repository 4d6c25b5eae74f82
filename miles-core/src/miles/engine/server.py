"""The HTTP face of the local engine: SGLang's native endpoints over a :class:`Scheduler` (FastAPI).

Generation errors are HTTP 400 ``{"error": {"message": ...}}``; admin errors are HTTP 400
``{"success": false, "message": ...}`` (SGLang's shapes). With an API key every route needs
``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import typing
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from miles.engine.api_schema import describe_bodies
from miles.engine.faults import die_in_generate_if_asked
from miles.engine.parsing import RequestError, parse_generate
from miles.engine.request import Request
from miles.engine.responses import admin, generate_error, json_body
from miles.engine.state import EngineState
from miles.rollout.protocol import INSTANCE_HEADER
from miles.types import PauseMode

__all__ = ["EngineState", "create_app"]

log = logging.getLogger(__name__)

_PAUSE_MODES = typing.get_args(PauseMode)


def create_app(state: EngineState) -> FastAPI:
    """The FastAPI application serving ``state``."""
    app = FastAPI(title="miles local engine")
    sched = state.scheduler

    @app.middleware("http")
    async def _auth(request: HTTPRequest, call_next: Callable[[HTTPRequest], Any]) -> Any:
        if state.api_key is not None and request.headers.get("authorization", "") != f"Bearer {state.api_key}":
            return generate_error("missing or wrong API key (Authorization: Bearer <key>)", 401)
        return await call_next(request)

    async def _run(body: Any) -> tuple[Any, bool, list[asyncio.Queue[tuple[dict[str, Any], bool]]], list[Request]]:
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue[tuple[dict[str, Any], bool]]] = []
        version = lambda: sched.weight_version  # noqa: E731

        def sink_factory(i: int) -> Callable[[Request, bool], None]:
            q: asyncio.Queue[tuple[dict[str, Any], bool]] = asyncio.Queue()
            queues.append(q)

            def sink(req: Request, done: bool) -> None:
                payload = req.to_response(state.decode_each, version())
                loop.call_soon_threadsafe(q.put_nowait, (payload, done))

            return sink

        batch = parse_generate(
            body,
            encode=state.encode,
            vocab_size=sched.runner.vocab_size,
            context_length=sched.context_length,
            sink_factory=sink_factory,
            return_original_logprob_default=state.return_original_logprob,
        )
        unknown = sorted(
            {r.lora_name for r in batch.requests if r.lora_name and r.lora_name not in sched.runner.lora.adapters}
        )
        if unknown:
            raise RequestError(
                f"lora_path: LoRA adapter {', '.join(map(repr, unknown))} is not loaded (/load_lora_adapter)"
            )
        sched.add(batch.requests)
        return batch, batch.stream, queues, batch.requests

    @app.post("/generate")
    async def generate(request: HTTPRequest) -> Any:
        die_in_generate_if_asked()
        try:
            body = await json_body(request)
            batch, stream, queues, reqs = await _run(body)
        except RequestError as exc:
            return generate_error(str(exc))
        state.generate_requests += 1
        state.generated_samples += len(reqs)
        if not stream:
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

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200, headers={INSTANCE_HEADER: state.instance})

    @app.get("/health_generate")
    async def health_generate() -> Any:
        if sched.paused is not None:  # alive, but generation waits for /continue_generation
            return Response(status_code=200)
        body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        _, _, queues, _ = await _run(body)
        payload, _ = await asyncio.wait_for(queues[0].get(), timeout=120)
        if payload["meta_info"]["finish_reason"]["type"] == "abort":
            return Response(status_code=503)
        return Response(status_code=200)

    def _model_info() -> dict[str, Any]:
        return {
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "weight_version": sched.weight_version,
            "model_type": sched.runner.config.model_type,
            "architectures": getattr(sched.runner.config, "architectures", None),
            "num_hidden_layers": len(sched.runner.layers),
            "moe_layers": sched.runner.moe_layers,
            "num_experts_per_tok": sched.runner.topk,
            "vocab_size": sched.runner.vocab_size,
            "context_length": sched.context_length,
        }

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return _model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        from miles._version import __version__

        stats = await asyncio.wrap_future(sched.submit(sched.stats))
        counters = {"generate_requests": state.generate_requests, "generated_samples": state.generated_samples}
        return {
            **state.server_args,
            **stats,
            **counters,
            "version": __version__,
            "weight_version": sched.weight_version,
        }

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": sched.weight_version}

    @app.post("/abort_request")
    async def abort_request(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            rid = body.get("rid")
            if body.get("abort_all") or rid in (None, ""):
                count = await asyncio.wrap_future(sched.submit(sched._abort, None, "aborted by /abort_request"))
            else:
                count = await asyncio.wrap_future(sched.submit(sched._abort, str(rid), "aborted by /abort_request"))
            return {"success": True, "num_aborted": count}

        return await admin(request, run)

    @app.post("/pause_generation")
    async def pause_generation(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            mode = body.get("mode", "abort")
            if mode not in _PAUSE_MODES:
                raise RequestError(f"mode must be one of {', '.join(_PAUSE_MODES)}, got {mode!r}")
            await asyncio.wrap_future(sched.submit(sched.pause, mode))
            return {"success": True, "message": f"generation paused (mode {mode})"}

        return await admin(request, run)

    @app.post("/continue_generation")
    async def continue_generation(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            await asyncio.wrap_future(sched.submit(sched.resume))
            return {"success": True, "message": "generation continued"}

        return await admin(request, run)

    @app.get("/flush_cache", operation_id="flush_cache_get")
    @app.post("/flush_cache", operation_id="flush_cache_post")
    async def flush_cache() -> Any:
        await asyncio.wrap_future(sched.submit(sched.flush_cache))
        return {"success": True, "message": "cache flushed"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise RequestError("model_path (a safetensors directory) is required")
            path = state.weight_path(path, field="model_path")
            version = body.get("weight_version")
            new = await asyncio.wrap_future(
                sched.submit(
                    sched.update_weights,
                    path,
                    None if version is None else str(version),
                    bool(body.get("flush_cache", True)),
                    bool(body.get("abort_all_requests", False)),
                )
            )
            return {"success": True, "message": f"weights loaded from {path}", "weight_version": new}

        return await admin(request, run)

    @app.post("/update_weight_version")
    async def update_weight_version(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            version = body.get("new_version", body.get("weight_version"))
            if version is None:
                raise RequestError("new_version is required")
            if body.get("abort_all_requests"):
                await asyncio.wrap_future(sched.submit(sched._abort, None, "aborted by /update_weight_version"))
            await asyncio.wrap_future(sched.submit(sched.set_weight_version, str(version)))
            return {"success": True, "message": "weight version updated", "new_version": str(version)}

        return await admin(request, run)

    from miles.engine.p2p_routes import add_p2p_routes
    from miles.engine.weight_delta import add_delta_routes
    from miles.engine.weight_routes import add_weight_routes

    add_weight_routes(app, state, admin)
    add_delta_routes(app, state, admin)
    add_p2p_routes(app, state, admin)
    from miles.engine.lora_routes import add_lora_routes

    add_lora_routes(app, state, admin)
    describe_bodies(app, vocab_size=sched.runner.vocab_size, context_length=sched.context_length)
    return app
