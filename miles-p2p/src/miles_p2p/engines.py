"""Rank 0's side of a p2p session: the calls to the engines' ``/p2p/*`` routes (:mod:`miles_p2p.routes`).

The transport (:mod:`miles_p2p.transport`) runs the collectives every trainer rank takes part in; when a step
needs the engines, rank 0 asks them through an :class:`EngineSessions` and broadcasts what they answered, a
failure as ``{"error": ...}`` so that every rank raises at the same point. Nothing here is a collective.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from miles.errors import EngineError

if TYPE_CHECKING:
    from miles.rollout.client import EngineClient
    from miles_p2p.plan import RoutePlan
    from miles_p2p.settings import P2PTransportSettings

__all__ = ["EngineSessions"]


class EngineSessions:
    """The session of one push stream on every engine: opened, given plans, told to begin, receive, commit,
    asked for checksums, aborted and closed. Each call returns ``{"answers": [...]}`` / ``{"ok": True}`` or
    ``{"error": message}`` (broadcast as such to the other ranks)."""

    def __init__(self, client: EngineClient, settings: P2PTransportSettings) -> None:
        self.client = client
        self.settings = settings
        self.session_id = ""
        self.urls: list[str] = []
        self.failed: set[str] = set()
        """Engines whose part of the last push failed (not asked to close their session)."""
        self.shm_files: list[str] = []
        """``shm`` without direct writes: the ``/dev/shm`` buffers of the current plan (rank 0 made them)."""

    async def open(
        self, meta: dict[str, Any], backend: str, trainer_ranks: int, rendezvous: asyncio.Future[Any] | None
    ) -> dict[str, Any]:
        """``/p2p/open_session`` on every engine of ``meta["urls"]`` (concurrently with the torch group's
        ``rendezvous``, which the engines join)."""
        self.session_id, self.urls = meta["session"], list(meta["urls"])
        client, settings = self.client, self.settings

        async def open_one(i: int, url: str) -> dict[str, Any]:
            body: dict[str, Any] = {
                "session_id": meta["session"],
                "datapath": settings.datapath,
                "timeout": settings.timeout,
            }
            if settings.datapath == "torch":
                body.update(
                    master_address=meta["address"],
                    master_port=meta["port"],
                    world_size=trainer_ranks + len(meta["urls"]),
                    rank=trainer_ranks + i,
                    backend=backend,
                )
            elif settings.datapath == "mooncake":
                body.update(
                    hostname=urlparse(url).hostname or "127.0.0.1",
                    protocol=settings.mooncake_protocol,
                    device_name=settings.mooncake_device,
                )
            try:
                return await client.call(url, "/p2p/open_session", body)
            except Exception as exc:
                hint = ""
                if getattr(exc, "status", None) == 404:  # the routes come with miles-p2p, in the engine's environment
                    hint = " (the engine serves no /p2p routes: install miles-p2p where the engine runs)"
                raise EngineError(f"p2p transport: opening a session on engine {url} failed: {exc}{hint}") from exc

        tasks = [asyncio.ensure_future(open_one(i, url)) for i, url in enumerate(self.urls)]
        pending: set[asyncio.Future[Any]] = set(tasks)
        if rendezvous is not None:
            pending.add(rendezvous)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                error = task.exception()
                if error is not None:
                    for other in pending:
                        other.cancel()
                    return {"error": str(error)}
        return {"answers": [t.result() for t in tasks]}

    def _shared_files(self, plan: RoutePlan) -> list[str]:
        """``shm``: one ``/dev/shm`` file per group of engines with the same chunks."""
        self.unlink_shared_files()
        by_layout: dict[str, str] = {}
        paths = []
        for e in range(len(self.urls)):
            signature = repr([(r.name, r.offsets, r.shape, r.src, r.offset) for r in plan.for_engine(e)])
            if signature not in by_layout:
                path = f"/dev/shm/{self.session_id}-{plan.plan_id}-{len(by_layout)}"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, max(plan.buffer_bytes[e], 1))
                finally:
                    os.close(fd)
                by_layout[signature] = path
                self.shm_files.append(path)
            paths.append(by_layout[signature])
        return paths

    def unlink_shared_files(self) -> None:
        """Remove the names of the ``/dev/shm`` buffers (mappings of them stay valid until let go of)."""
        for path in self.shm_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.shm_files = []

    async def send_plan(self, plan: RoutePlan) -> dict[str, Any]:
        """``/p2p/plan``: each engine its chunks (it allocates, registers or maps its receive buffer)."""
        client, settings = self.client, self.settings
        staged_shm = settings.datapath == "shm" and not settings.write_into_weights
        paths = self._shared_files(plan) if staged_shm else [None] * len(self.urls)

        async def one(e: int, url: str) -> dict[str, Any]:
            body: dict[str, Any] = {
                "session_id": self.session_id,
                "plan_id": plan.plan_id,
                "chunks": [r.chunk() for r in plan.for_engine(e)],
            }
            if paths[e] is not None:
                body["buffer_path"] = paths[e]
            if settings.write_into_weights:
                body["direct"] = True
            try:
                answer = await client.call(url, "/p2p/plan", body)
            except Exception as exc:
                raise EngineError(f"p2p transport: engine {url} refused the plan: {exc}") from exc
            return answer if paths[e] is None else {**answer, "buffer_path": paths[e]}

        try:
            return {"answers": list(await asyncio.gather(*(one(e, url) for e, url in enumerate(self.urls))))}
        except EngineError as exc:
            return {"error": str(exc)}

    async def begin(self, plan: RoutePlan, version: str) -> dict[str, Any]:
        """Direct writes: every engine pauses (``/p2p/begin``); if one cannot, the others resume."""
        client = self.client
        body = {"session_id": self.session_id, "plan_id": plan.plan_id, "version": version}
        results = await asyncio.gather(
            *(client.call(url, "/p2p/begin", body) for url in self.urls), return_exceptions=True
        )
        failed = [(url, r) for url, r in zip(self.urls, results, strict=True) if isinstance(r, BaseException)]
        if not failed:
            return {"ok": True}
        begun = [url for url, r in zip(self.urls, results, strict=True) if not isinstance(r, BaseException)]
        await asyncio.gather(
            *(client.call(url, "/p2p/abort", {"session_id": self.session_id, "resume": True}) for url in begun),
            return_exceptions=True,
        )
        url, error = failed[0]
        return {"error": f"p2p transport: engine {url} could not begin version {version}: {error}"}

    def start_receives(self, plan: RoutePlan, version: str) -> list[asyncio.Task[Any]]:
        """Every engine's ``/p2p/receive``, the first phase (``torch``: they post the receives the ranks send
        to, so before the sends; one-sided data paths: after them, each engine confirms it is alive and ready
        before any engine commits)."""
        body = {"session_id": self.session_id, "plan_id": plan.plan_id, "version": version}
        return [asyncio.create_task(self.client.call(url, "/p2p/receive", body)) for url in self.urls]

    async def finish(
        self,
        plan: RoutePlan,
        version: str,
        outcomes: list[dict[str, Any]],
        receives: list[asyncio.Task[Any]],
        metrics: dict[str, float],
    ) -> dict[str, Any]:
        """Commit on every engine if every chunk arrived everywhere (every rank's ``outcomes``), else abort
        (naming the engine)."""
        client = self.client
        errors: dict[int, str] = {}
        written: dict[int, list[int]] = {}
        for o in outcomes:
            for e, message in o["errors"].items():
                errors.setdefault(int(e), message)
            for e, ids in o["written"].items():
                written.setdefault(int(e), []).extend(ids)
        ready = time.perf_counter()
        for e in errors:  # a rank saw it fail (a dead engine): no need to wait for its answer
            if e < len(receives):
                receives[e].cancel()
        for e, result in enumerate(await asyncio.gather(*receives, return_exceptions=True)):
            if isinstance(result, BaseException):
                errors.setdefault(e, str(result))
        transfer = time.perf_counter()
        if errors:
            self.failed = {self.urls[e] for e in errors}
            alive = [url for e, url in enumerate(self.urls) if e not in errors]
            body = {"session_id": self.session_id, "resume": False}
            await asyncio.gather(*(client.call(url, "/p2p/abort", body) for url in alive), return_exceptions=True)
            e = min(errors)
            others = (
                "the other engines stay paused on partial weights until a push completes (write_into_weights)"
                if self.settings.write_into_weights
                else "the other engines keep serving their version"
            )
            return {
                "error": f"p2p transport: version {version} did not reach engine {self.urls[e]}: {errors[e]}; {others}"
                + (f" ({len(errors) - 1} more engine(s) failed)" if len(errors) > 1 else "")
            }
        one_sided = self.settings.datapath != "torch"

        async def commit(e: int, url: str) -> Any:
            body = {
                "session_id": self.session_id,
                "plan_id": plan.plan_id,
                "version": version,
                "written": sorted(written.get(e, [])) if one_sided else None,
                "flush_cache": True,
            }
            try:
                return await client.call(url, "/p2p/commit", body)
            except Exception as exc:
                raise EngineError(f"p2p transport: engine {url} did not load version {version}: {exc}") from exc

        results = await asyncio.gather(*(commit(e, url) for e, url in enumerate(self.urls)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            return {"error": str(failed[0])}
        metrics["weight_sync/commit_seconds"] = time.perf_counter() - transfer
        metrics["weight_sync/engine_commit_seconds"] = max(
            float(r.get("seconds", 0.0)) for r in results if not isinstance(r, BaseException)
        )
        metrics["weight_sync/ready_seconds"] = transfer - ready
        return {"ok": True}

    async def checksums(self) -> list[dict[str, Any] | BaseException]:
        """``/p2p/checksums`` of every engine (engine 0's with every tensor's full checksum too)."""
        client = self.client
        return list(
            await asyncio.gather(
                *(
                    client.call(url, "/p2p/checksums", {"session_id": self.session_id, "full": e == 0})
                    for e, url in enumerate(self.urls)
                ),
                return_exceptions=True,
            )
        )

    async def close(self) -> None:
        """``/p2p/close_session`` on the engines still there (a dead engine has nothing to close; a restarted
        one never had it), and the ``/dev/shm`` names removed."""
        if self.session_id:
            client = self.client
            reachable = set(client.urls) - self.failed
            body = {"session_id": self.session_id}
            await asyncio.gather(
                *(client.call(url, "/p2p/close_session", body) for url in self.urls if url in reachable),
                return_exceptions=True,
            )
        self.failed = set()
        self.unlink_shared_files()
