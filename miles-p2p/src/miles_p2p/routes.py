"""The local engine's HTTP routes of point-to-point weight updates (Miles endpoints; see
:mod:`miles_p2p.receiver`), added by the ``p2p`` plugin through ``miles_engine_routes``. They use the engine
through its declared public modules only (:mod:`miles.engine.state`, :mod:`miles.engine.weights`,
:mod:`miles.engine.responses`).

- ``/p2p/open_session {session_id, datapath, ...}``: set the data path up (``torch``: ``master_address,
  master_port, world_size, rank, backend, timeout`` join the trainer's group, blocking until every member
  has joined; ``mooncake``: ``hostname, protocol, device_name``; ``shm``: nothing). Answers the served
  tensors (``name, dtype, shape``), the tied ``aliases``, ``host_id`` and, for Mooncake, its session.
- ``/p2p/plan {session_id, plan_id, chunks, buffer_path}``: the chunks this engine receives; allocates (and
  for Mooncake registers) the receive buffer, or maps the trainer's ``/dev/shm`` file ``buffer_path``
  (``shm``); answers ``buffer_bytes`` and, for Mooncake, ``buffer_address``.
- ``/p2p/receive {session_id, plan_id, version}``: the first phase: ``torch``: receive every chunk
  (generation goes on); one-sided data paths: the chunks are in, the engine is alive and ready.
- ``/p2p/commit {session_id, plan_id, version, written, flush_cache}``: pause (``retract``) unless paused,
  copy the chunks into the parameters, set the version, flush the prefix cache, resume — the sequence of
  every weight update. ``written``: the chunk ids the trainer ranks wrote (one-sided data paths).
- ``/p2p/checksums {session_id, full}``: a checksum per chunk of what is served (and per tensor with ``full``).
- ``/p2p/begin {session_id, plan_id, version}``: direct writes (``/p2p/plan`` with ``direct``: the engine
  shares its weights and answers their ``regions`` and each chunk's place): pause, then the ranks write.
- ``/p2p/abort {session_id, resume}`` forgets a received version (direct writes: resumes generation only
  if nothing was written); ``/p2p/close_session {session_id}`` frees it all.

SGLang's counterpart is its remote-instance weight loading with the Mooncake Transfer Engine
(``/remote_instance_transfer_engine_info`` gives the session and the registered weights' addresses; the
trainer writes into them, then ``/update_weight_version``), and ``/init_weights_update_group`` +
``/update_weights_from_distributed`` for the NCCL path.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from miles.engine.responses import admin
from miles.engine.weights import parameter_aliases, served_parameters
from miles.torch_threads import to_thread
from miles_p2p.receiver import Chunk, P2PSession

if TYPE_CHECKING:
    from miles.engine.state import EngineState

__all__ = ["add_p2p_routes"]

log = logging.getLogger(__name__)


def _session_id(body: dict[str, Any]) -> str:
    value = body.get("session_id")
    if not isinstance(value, str) or not value:
        raise ValueError("session_id is required (a string)")
    return value


def add_p2p_routes(app: FastAPI, state: EngineState) -> None:
    """Mount the ``/p2p/*`` routes on ``app``."""
    sched = state.scheduler
    sessions: dict[str, P2PSession] = {}
    partial = {"paused": False}
    """Generation is paused on the partial weights of a direct write that stopped midway: it stays paused,
    whatever session comes next, until a push completes (its commit resumes it)."""

    def session(body: dict[str, Any]) -> P2PSession:
        sid = _session_id(body)
        found = sessions.get(sid)
        if found is None:
            raise ValueError(f"no p2p session {sid!r} (call /p2p/open_session first)")
        return found

    on_scheduler = state.on_scheduler

    def randomize(seed: int) -> None:
        for s in sessions.values():
            s.randomize(seed)

    state.on_randomize.append(randomize)

    @app.post("/p2p/open_session")
    async def open_session(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            sid = _session_id(body)
            if sid in sessions:
                raise ValueError(f"p2p session {sid!r} already exists")
            datapath = str(body.get("datapath", ""))
            device = state.device
            # joining a group blocks until every member arrives: off the event loop and the scheduler
            created = await to_thread(lambda: P2PSession(sid, datapath, body, device))
            sessions[sid] = created
            model = state.model
            tensors = [
                {"name": n, "dtype": str(p.dtype).removeprefix("torch."), "shape": list(p.shape)}
                for n, p in model.named_parameters()
            ]
            log.info("p2p session %r opened (%s)", sid, datapath)
            return {"success": True, **created.info(), "tensors": tensors, "aliases": parameter_aliases(model)}

        return await admin(request, run)

    @app.post("/p2p/plan")
    async def plan(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            s = session(body)
            raw = body.get("chunks")
            if not isinstance(raw, list):
                raise ValueError("chunks is required (a list)")
            chunks = [Chunk.parse(c) for c in raw]
            plan_id = str(body.get("plan_id", ""))
            params = served_parameters(state.model)
            path = body.get("buffer_path")
            direct = bool(body.get("direct", False))
            if direct:  # moving the weights to shared memory must not race a forward pass
                info = await on_scheduler(s.set_plan, plan_id, chunks, params, None, True)
            else:
                info = await to_thread(s.set_plan, plan_id, chunks, params, None if path is None else str(path))
            log.info(
                "p2p session %r: plan %s, %d chunks, %.1f MB buffer",
                s.id,
                plan_id,
                len(chunks),
                info["buffer_bytes"] / 1e6,
            )
            return {"success": True, **info}

        return await admin(request, run)

    @app.post("/p2p/receive")
    async def receive(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            s = session(body)
            seconds = await to_thread(s.receive, str(body.get("plan_id")), str(body.get("version")))
            return {"success": True, "seconds": seconds}

        return await admin(request, run)

    @app.post("/p2p/begin")
    async def begin(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            s = session(body)
            version = str(body.get("version", ""))

            def go() -> None:
                s.begin(str(body.get("plan_id")), version, served_parameters(state.model))
                # paused on an earlier partial write: this push's commit resumes, its abort keeps the pause
                s.after_partial, partial["paused"] = partial["paused"], False
                s.paused_by_begin = sched.paused is None or s.after_partial
                if sched.paused is None:
                    sched.pause("retract")

            await on_scheduler(go)
            return {"success": True, "message": f"generation paused; the trainer may write version {version!r}"}

        return await admin(request, run)

    @app.post("/p2p/commit")
    async def commit(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            s = session(body)
            version = body.get("version")
            if not isinstance(version, str) or not version:
                raise ValueError("version is required (a string)")
            written = body.get("written")
            if written is not None and not isinstance(written, list):
                raise ValueError("written must be a list of chunk ids")
            flush = bool(body.get("flush_cache", True))

            def load() -> tuple[int, float]:
                start = time.perf_counter()
                if s.direct:  # paused since /p2p/begin; the weights were written in place
                    count = s.commit(str(body.get("plan_id")), version, served_parameters(state.model), written)
                    state.weights_written()  # prepacked copies were not told of the writes
                    if s.paused_by_begin:
                        s.paused_by_begin = False
                        sched.resume()
                    was_paused = True
                else:
                    was_paused = sched.paused is not None
                if not was_paused:
                    sched.pause("retract")
                try:
                    if not s.direct:
                        count = s.commit(str(body.get("plan_id")), version, served_parameters(state.model), written)
                finally:
                    if not was_paused:
                        sched.resume()
                sched.set_weight_version(version)
                if flush:
                    sched.flush_cache()
                if partial["paused"]:  # a complete version replaced the partial one
                    partial["paused"] = False
                    sched.resume()
                    log.warning("p2p: version %s is in; generation continues after the partial push", version)
                return count, time.perf_counter() - start

            count, seconds = await on_scheduler(load)
            return {"success": True, "weight_version": sched.weight_version, "chunks": count, "seconds": seconds}

        return await admin(request, run)

    @app.post("/p2p/checksums")
    async def checksums(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            s = session(body)

            def compute() -> dict[str, Any]:
                model = state.model
                chunks = s.chunk_checksums(served_parameters(model))
                out: dict[str, Any] = {"chunks": chunks}
                if body.get("full"):  # (a chunk that is a whole tensor has its checksum: not read twice)
                    out["full"] = s.full_checksums(model, chunks)
                return out

            result = await on_scheduler(compute)
            return {"success": True, "weight_version": sched.weight_version, **result}

        return await admin(request, run)

    @app.post("/p2p/abort")
    async def abort(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            s = session(body)
            s.received = None
            if s.direct and s.writing is not None:

                def stop() -> str:
                    s.writing = None
                    if body.get("resume", True) and s.paused_by_begin and not s.after_partial:  # nothing written
                        s.paused_by_begin = False
                        sched.resume()
                        return "nothing was written; generation continues"
                    if s.paused_by_begin:  # paused for the write: held until a push completes
                        s.paused_by_begin = False
                        partial["paused"] = True
                    log.error("p2p session %r: a direct write stopped midway; generation stays paused", s.id)
                    return "the weights hold a partial version: generation stays paused until a push completes"

                return {"success": True, "message": await on_scheduler(stop)}
            return {"success": True, "message": f"p2p session {s.id!r}: nothing staged"}

        return await admin(request, run)

    @app.post("/p2p/close_session")
    async def close_session(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            sid = _session_id(body)
            s = sessions.pop(sid, None)
            if s is None:
                raise ValueError(f"no p2p session {sid!r}")
            await on_scheduler(s.close)
            return {"success": True, "message": f"p2p session {sid!r} closed"}

        return await admin(request, run)
