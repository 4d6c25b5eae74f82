"""HTTP routes of distributed weight updates and weight verification (see :mod:`miles.engine.weight_sync`).

SGLang's names and fields: ``/init_weights_update_group {master_address, master_port, rank_offset,
world_size, group_name, backend}``, ``/begin_weight_update {}`` and ``/end_weight_update {}`` around
``/update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, weight_version}``,
``/destroy_weights_update_group {group_name}``; ``/update_weights_from_tensor {serialized_named_tensors,
load_format, flush_cache, weight_version}`` (a colocated trainer's tensors by handle, one payload per TP
rank: one here; :mod:`miles.transport.tensor_ipc`); SGLang's ``/release_memory_occupation {tags}`` /
``/resume_memory_occupation {tags}`` for colocation and ``/get_weights_by_name {name, truncate_size}`` (the
first rows of a parameter, for sampled verification). (``/weights_checksum`` and ``/debug/randomize_weights``
are the protocol's shared routes: :mod:`miles.engine.protocol_app`.) The built-in plugin ``local_engine``
adds these routes (``miles_engine_routes``).

A distributed update arrives in several buckets; the first one pauses generation (``retract``: running
requests give back their KV and are recomputed on the new weights), and the version bump that closes
the update (the call that carries ``weight_version``; the trainer sends it last, with an empty bucket)
resumes it — so no request ever decodes on half-updated weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from miles.engine.faults import die_in_push_if_asked
from miles.engine.responses import admin
from miles.engine.weight_sync import MemoryOccupation, WeightGroups, load_named_tensors, weights_by_name
from miles.torch_threads import to_thread

if TYPE_CHECKING:
    from miles.engine.state import EngineState

__all__ = ["add_weight_routes"]


def _require(body: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{key} is required ({getattr(kind, '__name__', kind)})")
    return value


def add_weight_routes(app: FastAPI, state: EngineState) -> None:
    """Mount the routes on ``app``."""
    sched = state.scheduler
    groups = WeightGroups()
    updating = {"auto_paused": False, "buckets": 0}

    run_on_scheduler = state.on_scheduler

    def begin_update() -> None:
        if sched.paused is None:
            sched.pause("retract")
            updating["auto_paused"] = True

    def finish_update(version: str | None, flush: bool) -> None:
        if version is not None:
            updating["buckets"] = 0
            sched.set_weight_version(version)
        if flush:
            sched.flush_cache()
        if version is not None and updating["auto_paused"]:
            updating["auto_paused"] = False
            sched.resume()

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            kwargs = {
                "master_address": _require(body, "master_address", str),
                "master_port": _require(body, "master_port", int),
                "rank_offset": _require(body, "rank_offset", int),
                "world_size": _require(body, "world_size", int),
                "group_name": str(body.get("group_name", "weight_update_group")),
                "backend": str(body.get("backend", "gloo")),
                "device": sched.runner.device,
            }
            # joining blocks until every rank arrives: keep it off the event loop and the scheduler
            await to_thread(lambda: groups.init(**kwargs))
            return {"success": True, "message": f"joined weight update group {kwargs['group_name']!r}"}

        return await admin(request, run)

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            await run_on_scheduler(begin_update)
            return {"success": True, "message": "weight update begun (generation paused)"}

        return await admin(request, run)

    @app.post("/end_weight_update")
    async def end_weight_update(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            def end() -> None:
                if updating["auto_paused"]:
                    updating["auto_paused"] = False
                    sched.resume()

            await run_on_scheduler(end)
            return {"success": True, "message": "weight update ended"}

        return await admin(request, run)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            names = _require(body, "names", list)
            dtypes = _require(body, "dtypes", list)
            shapes = _require(body, "shapes", list)
            group_name = str(body.get("group_name", "weight_update_group"))
            version = body.get("weight_version")

            def receive() -> int:
                begin_update()
                if names:
                    updating["buckets"] += 1
                    die_in_push_if_asked(updating["buckets"])
                count = groups.receive(
                    sched.runner.model, group_name=group_name, names=names, dtypes=dtypes, shapes=shapes
                )
                finish_update(None if version is None else str(version), bool(body.get("flush_cache", True)))
                return count

            count = await run_on_scheduler(receive)
            return {"success": True, "message": f"received {count} tensors", "weight_version": sched.weight_version}

        return await admin(request, run)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            from miles.transport.tensor_ipc import load_handles

            payloads = _require(body, "serialized_named_tensors", list)
            if len(payloads) != 1 or not isinstance(payloads[0], str):
                raise ValueError(
                    "serialized_named_tensors: one payload (a string) per TP rank, and this engine has one; "
                    f"got {len(payloads)} entries"
                )
            if body.get("load_format") not in (None, "direct"):
                raise ValueError(f"load_format: {body.get('load_format')!r} is not served (only the default)")
            version = body.get("weight_version")

            def receive() -> int:
                named = load_handles(payloads[0])
                begin_update()
                if named:
                    updating["buckets"] += 1
                    die_in_push_if_asked(updating["buckets"])
                count = load_named_tensors(sched.runner.model, dict(named))
                if named and named[0][1].is_cuda:
                    import torch

                    torch.cuda.synchronize()  # copied before the answer: the sender then frees its tensors
                finish_update(None if version is None else str(version), bool(body.get("flush_cache", True)))
                return count

            count = await run_on_scheduler(receive)
            return {"success": True, "message": f"loaded {count} tensors", "weight_version": sched.weight_version}

        return await admin(request, run)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            name = str(body.get("group_name", "weight_update_group"))
            await run_on_scheduler(groups.destroy, name)
            return {"success": True, "message": f"destroyed weight update group {name!r}"}

        return await admin(request, run)

    memory = MemoryOccupation()

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            report = await run_on_scheduler(memory.release, sched, body.get("tags"))
            return {"success": True, "message": "memory released", **report}

        return await admin(request, run)

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            await run_on_scheduler(memory.resume, sched, body.get("tags"))
            return {"success": True, "message": "memory resumed"}

        return await admin(request, run)

    @app.get("/get_weights_by_name", operation_id="get_weights_by_name_get")
    @app.post("/get_weights_by_name", operation_id="get_weights_by_name_post")
    async def get_weights_by_name(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            name = _require(body, "name", str)
            size = body.get("truncate_size", 100)
            if not isinstance(size, int) or isinstance(size, bool):
                raise ValueError("truncate_size must be an integer")
            return await run_on_scheduler(weights_by_name, sched.runner.model, name, size)

        return await admin(request, run)
