"""The ``p2p`` transport: every trainer rank sends the slices it holds straight to the engines that need them.

Nothing is gathered on rank 0: each rank reads its own shards (:meth:`~miles.training.trainer.Trainer.
iter_weight_shards`, the FSDP2 DTensor shards for the ``fsdp`` trainer); the buckets :meth:`P2PTransport.
push` receives are never iterated. One push:

1. every rank gathers the others' slice layouts (names and boxes, JSON) and, when the layouts or the
   engines changed, every rank computes the same route plan (:mod:`miles_p2p.plan`); rank 0 gives each
   engine its chunks (``/p2p/plan``), which allocates (registers, maps) its receive buffer once;
2. each rank moves its chunks into the engines' receive buffers (:mod:`miles_p2p.datapaths`) while the
   engines keep generating;
3. rank 0 collects every rank's outcome. If an engine failed (it died, refused, timed out), the push
   fails naming its URL and the other engines, whose parameters were never touched, keep serving their
   version (with ``write_into_weights`` they stay paused on the partial weights until a push completes);
   the sessions are closed on every rank and reopened at the next push. Otherwise every engine commits
   (``/p2p/commit``: pause, copy into the parameters, version, flush, resume);
4. verification (``verify_slices``): each rank's checksum of every chunk it sent against each engine's
   checksum of that chunk as served, naming the tensor, the box and the rank on a mismatch; the per-tensor
   checksums the driver then verifies on every engine are engine 0's, proven equal to the trainer's bytes
   by that check.

Every rank takes part in every step (small JSON collectives over the trainer's default process group),
so a failure is raised on every rank, at the same point: none is left waiting in a collective. The
publisher then pushes the whole version again to the engines left
(:class:`~miles.driver.publish.InlinePublisher`).

The sessions follow the engines that take control calls (:mod:`miles.rollout.failover`): before each push
rank 0 compares them with the engines of the sessions, and when one left (it died) or one rejoins (a
restarted engine has no session: it needs a new one and a full push) every rank closes the sessions and
opens new ones, on the engines there are now; the plan is made again for them.

Rank 0 speaks to the engines through :class:`~miles_p2p.engines.EngineSessions`; the engine side is the
local engine's ``/p2p/*`` routes (:mod:`miles_p2p.routes`), which this package's plugin adds to every local
engine (``miles_engine_routes``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from miles.components import Requirement
from miles.errors import EngineError, SettingsError, WeightVerificationError
from miles.torch_threads import to_thread
from miles.transport.base import PushReport, WeightTransport
from miles_p2p.engines import EngineSessions
from miles_p2p.plan import EngineLayout, Route, RoutePlan, SliceInfo, engines_digest, layout_key, make_plan
from miles_p2p.settings import P2PTransportSettings

if TYPE_CHECKING:
    import torch

    from miles.rollout.client import EngineClient
    from miles.settings.model import MilesSettings
    from miles.training.trainer import DistContext, Trainer, WeightBucket, WeightShard
    from miles_p2p.datapaths import Outcome, Sender
    from miles_p2p.endpoint import MooncakeEndpoint

__all__ = ["MOONCAKE", "P2PTransport"]

MOONCAKE = Requirement(
    "mooncake", extra="mooncake", distribution="miles-p2p", package="the Mooncake Transfer Engine (mooncake)"
)
"""What ``datapath = "mooncake"`` sends with (and the engines receive with)."""

log = logging.getLogger(__name__)


def _check_options(options: P2PTransportSettings) -> None:
    if options.write_into_weights and options.datapath != "shm":
        raise SettingsError(f"transport.write_into_weights needs transport.datapath = 'shm' (not {options.datapath!r})")


class P2PTransport(WeightTransport[P2PTransportSettings]):
    """Sends each trainer rank's slices straight to the engines (see the module docstring)."""

    name = "p2p"
    engine_routes = ("/p2p/open_session", "/p2p/plan", "/p2p/receive", "/p2p/commit", "/p2p/checksums")
    reads_buckets = False  # each rank sends its own slices (attach)

    def __init__(
        self, settings: P2PTransportSettings, *, run_dir: str, model_path: str | None, engine_dtype: str
    ) -> None:
        super().__init__(settings, run_dir=run_dir, model_path=model_path, engine_dtype=engine_dtype)
        self.trainer: Any = None
        self.client: EngineClient | None = None
        self.dist: DistContext | None = None
        self.session_id: str | None = None
        self.urls: list[str] = []
        self.engines: list[EngineLayout] = []
        self.opened = False
        self.group: Any = None
        self._store: Any = None
        self.endpoint: MooncakeEndpoint | None = None
        self.sender: Sender | None = None
        self.plan: RoutePlan | None = None
        self._engines_digest = ""
        self.sessions: EngineSessions | None = None
        """Rank 0: the session's calls to the engines."""

    @classmethod
    def requirements(cls, options: P2PTransportSettings) -> tuple[Requirement, ...]:
        """The Mooncake Transfer Engine when ``datapath = "mooncake"`` (``build_run`` checks it is installed)."""
        return (MOONCAKE,) if options.datapath == "mooncake" else ()

    @classmethod
    def check_settings(cls, options: P2PTransportSettings, settings: MilesSettings) -> None:
        """Before anything starts (``build_run`` calls it): ``write_into_weights`` needs the ``shm`` data
        path. Raises :class:`~miles.errors.SettingsError` naming the field."""
        _check_options(options)

    @property
    def address(self) -> str:
        """Where the engines reach this process: ``MILES_P2P_ADDRESS``, else ``transport.address``, else its
        node's address (:func:`miles.node_address.node_address`: trainer rank 0's node hosts the ``torch``
        group's store; each rank's own node is what its Mooncake endpoint advertises)."""
        from miles.node_address import node_address

        return os.environ.get("MILES_P2P_ADDRESS") or self.settings.address or node_address()

    # -- setup -------------------------------------------------------------------------------------
    def attach(self, trainer: Trainer) -> None:
        """Keep the trainer: its :meth:`~miles.training.trainer.Trainer.iter_weight_shards`, converted by its
        precision recipe's :meth:`~miles.precision.base.PrecisionRecipe.rollout_shards` (FP8, MXFP8, NVFP4
        values and scales made from each rank's rows), is what is sent."""
        precision = trainer.precision
        if precision is not None and not precision.converts_shards():
            raise SettingsError(
                f"transport p2p sends slices of the trainer ranks' weights; precision {precision.name!r} converts "
                "whole tensors only (it has rollout_weights, no rollout_shards): use transport broadcast, disk or "
                "disk_delta"
            )
        self.trainer = trainer

    async def connect(self, client: EngineClient | None, dist: DistContext) -> None:
        _check_options(self.settings)  # also when built without build_run (the kit, benchmarks)
        if self.trainer is None:
            raise RuntimeError("p2p transport: attach(trainer) must come before connect()")
        self.client = client
        self.dist = dist
        await self._open()

    def _rank0(self) -> EngineSessions:
        if self.sessions is None:
            raise RuntimeError("p2p transport: no session open on the engines (rank 0, after connect())")
        return self.sessions

    def _dist(self) -> DistContext:
        if self.dist is None:
            raise RuntimeError("p2p transport: push before connect()")
        return self.dist

    async def _open(self) -> None:
        """Open a session on every engine and set the data path up (a collective over the trainer ranks)."""
        from miles.net import host_store
        from miles.training.comm import all_gather_json, broadcast_json
        from miles.transport.broadcast import make_process_group, run_in_daemon_thread
        from miles_p2p.datapaths import MooncakeSender, ShmSender, TorchSender
        from miles_p2p.endpoint import MooncakeEndpoint, host_id

        dist = self._dist()
        datapath = self.settings.datapath
        meta: dict[str, Any] | None = None
        store: Any = None
        if dist.rank == 0:
            if self.client is None:
                raise RuntimeError("p2p transport: rank 0 needs the engine client")
            port = 0
            if datapath == "torch":  # bound before its port is told to anyone (0: the OS picks one)
                store, port = host_store(self.address, self.settings.port, timeout=self.settings.timeout)
            meta = {
                "session": f"miles-p2p-{uuid.uuid4().hex[:12]}",
                "urls": list(self.client.urls),
                "address": self.address,
                "port": port,
            }
        meta = broadcast_json(meta)
        assert meta is not None
        urls: list[str] = meta["urls"]
        backend = "nccl" if dist.device == "cuda" else "gloo"
        rendezvous: asyncio.Future[Any] | None = None
        if datapath == "torch":
            rank, world = dist.rank, dist.world_size + len(urls)
            rendezvous = run_in_daemon_thread(
                lambda: make_process_group(
                    backend,
                    host=meta["address"],
                    port=int(meta["port"]),
                    rank=rank,
                    world_size=world,
                    timeout=self.settings.timeout,
                    store=store,
                )
            )
        elif datapath == "mooncake":
            self.endpoint = MooncakeEndpoint(
                self.address, protocol=self.settings.mooncake_protocol, device_name=self.settings.mooncake_device
            )
        status = None
        if dist.rank == 0:
            assert self.client is not None
            self.sessions = EngineSessions(self.client, self.settings)
            status = await self.sessions.open(meta, backend, dist.world_size, rendezvous)
        status = broadcast_json(status)
        if "error" in status:
            raise EngineError(status["error"])
        answers: list[dict[str, Any]] = status["answers"]
        if datapath == "torch":
            assert rendezvous is not None
            self.group, self._store = await rendezvous
            self.sender = TorchSender(self.group, dist.world_size)
        elif datapath == "mooncake":
            assert self.endpoint is not None
            self.sender = MooncakeSender(self.endpoint)
        else:
            here = host_id()
            elsewhere = [url for url, a in zip(urls, answers, strict=True) if a["host_id"] != here]
            problems = all_gather_json(elsewhere[0] if elsewhere else None)
            far = next((p for p in problems if p), None)
            if far is not None:
                raise SettingsError(
                    f"transport.datapath = 'shm' needs every engine on the trainer ranks' host; {far} is not"
                )
            self.sender = ShmSender(direct=self.settings.write_into_weights)
        self.sender.checksum_written = self.settings.verify_slices
        self.session_id, self.urls = meta["session"], urls
        self.engines = [EngineLayout.from_session(url, a) for url, a in zip(urls, answers, strict=True)]
        self._engines_digest = engines_digest(self.engines)
        self.plan = None
        self.opened = True
        log.info("p2p transport: session %s on %d engines (%s)", self.session_id, len(urls), datapath)

    # -- planning ------------------------------------------------------------------------------------
    async def _replan(self, slices: list[SliceInfo]) -> None:
        """Compute the plan (every rank, the same) and give each engine its chunks (rank 0)."""
        from miles.training.comm import broadcast_json

        dist = self._dist()
        assert self.sender is not None
        plan = make_plan(slices, self.engines, extra=self.settings.datapath)
        status = await self._rank0().send_plan(plan) if dist.rank == 0 else None
        status = broadcast_json(status)
        if "error" in status:
            raise EngineError(status["error"])
        self.sender.prepare(plan.for_rank(dist.rank), status["answers"])
        self.plan = plan
        if self.settings.datapath == "shm" and not self.settings.write_into_weights:
            self._unlink_mapped_buffers()  # a collective
        log.info(
            "p2p transport: plan %s, %d chunks to %d engines (%.1f MB per engine)",
            plan.plan_id,
            len(plan.routes),
            len(self.engines),
            plan.tensor_bytes / 1e6,
        )

    def _unlink_mapped_buffers(self) -> None:
        """``shm``: once every engine (at the plan) and every trainer rank (just now) has mapped this plan's
        ``/dev/shm`` buffers, rank 0 removes their names; the mappings stay valid until each process lets go of
        them, so a run that ends any way at all — a SIGKILL included — leaves nothing in ``/dev/shm``. A later
        plan (an engine restarted, the layout changed) creates and maps new buffers."""
        from miles.training.comm import all_gather_json

        all_gather_json(True)  # every rank has mapped them (rank 0 created them: only it has names to remove)
        if self.sessions is not None:
            self.sessions.unlink_shared_files()

    # -- a push --------------------------------------------------------------------------------------
    def _sources(self, routes: list[Route], shards: list[WeightShard]) -> list[torch.Tensor]:
        """Each route's view of this rank's slice (the plan was made from these shards' layout)."""
        held = {(s.name, tuple(s.offsets)): s for s in shards}
        sources = []
        for route in routes:
            shard = held.get((route.source_name, route.slice_at))
            if shard is None:  # cannot happen: the plan's key covers every rank's layout
                raise RuntimeError(f"p2p transport: trainer rank {route.src} does not hold {route.describe()}")
            box = tuple(slice(o, o + n) for o, n in zip(route.slice_offsets, route.shape, strict=True))
            sources.append(shard.tensor.detach()[box])
        return sources

    def _send(self, routes: list[Route], sources: list[torch.Tensor]) -> Outcome:
        """This rank's data movement (a worker thread). Subclasses may wrap it."""
        assert self.sender is not None
        return self.sender.send(routes, sources)

    async def _send_all(self, routes: list[Route], sources: list[torch.Tensor]) -> Outcome:
        """:meth:`_send` on helper threads with one torch thread each (no second OpenMP pool,
        :mod:`miles.torch_threads`): as many as this rank computes with where the sender may run concurrently
        (shm: the casts and checksums of SmolLM2's 269 MB 47 -> 31 ms on two cores), else one."""
        import torch

        from miles_p2p.datapaths import Outcome

        assert self.sender is not None
        shares = min(torch.get_num_threads(), len(routes)) if self.sender.concurrent else 1
        if shares <= 1:
            return await to_thread(self._send, routes, sources)
        bins: list[list[int]] = [[] for _ in range(shares)]
        loads = [0] * shares
        for i in sorted(range(len(routes)), key=lambda i: -routes[i].nbytes):  # the largest first, to the lightest
            j = loads.index(min(loads))
            bins[j].append(i)
            loads[j] += routes[i].nbytes
        parts = await asyncio.gather(
            *(to_thread(self._send, [routes[i] for i in b], [sources[i] for i in b]) for b in bins if b)
        )
        return Outcome.merged(parts)

    async def push(self, buckets: Iterable[WeightBucket], *, version: str, dist: DistContext) -> PushReport:
        """Move every rank's slices to every engine, commit, verify (every rank; ``buckets`` is not read).
        A failure is raised on every rank; the sessions are closed then (the next push opens new ones)."""
        start = time.perf_counter()
        try:
            await self._follow_engines()
            return await self._push(version, dist, start)
        except Exception:
            await self._after_failure()
            raise

    async def _follow_engines(self) -> None:
        """Every rank: open the sessions, or open them again when the engines changed (see the module
        docstring)."""
        from miles.training.comm import broadcast_json

        change: str | None = None
        if self._dist().rank == 0 and self.opened and self.client is not None:
            now = list(self.client.urls)
            rejoining = [url for url in self.client.rejoining() if url in now]
            if now != self.urls:
                change = f"the engines changed ({', '.join(self.urls)} -> {', '.join(now)})"
            elif rejoining:
                change = f"{', '.join(rejoining)} rejoin(s)"
        change = broadcast_json(change)
        if change is not None:
            log.warning("p2p transport: %s; opening new sessions", change)
            await self._close_sessions()
        if not self.opened:
            await self._open()

    async def _push(self, version: str, dist: DistContext, start: float) -> PushReport:
        from miles.training.comm import all_gather_json, broadcast_json

        metrics: dict[str, float] = {}
        assert self.trainer is not None
        shards = list(self.trainer.iter_weight_shards())
        precision = self.trainer.precision
        if precision is not None:  # a collective: every rank converts its slices (quantized values, scales)
            try:
                shards = precision.rollout_shards(shards, all_gather_json)
            except ValueError as exc:
                raise SettingsError(f"transport p2p, precision {precision.name!r}: {exc}") from exc
        local = [SliceInfo(dist.rank, s.name, s.global_shape, s.offsets, tuple(s.tensor.shape)) for s in shards]
        gathered = all_gather_json([s.to_json() for s in local])
        slices = [SliceInfo.from_json(rank, row) for rank, rows in enumerate(gathered) for row in rows]
        if self.plan is None or self.plan.key != layout_key(slices, self._engines_digest, self.settings.datapath):
            plan_start = time.perf_counter()
            await self._replan(slices)
            metrics["weight_sync/plan_seconds"] = time.perf_counter() - plan_start
        plan = self.plan
        assert plan is not None
        routes = plan.for_rank(dist.rank)
        sources = self._sources(routes, shards)
        moved = time.perf_counter()
        if self.settings.write_into_weights:  # the engines pause before any rank writes into their weights
            began = await self._rank0().begin(plan, version) if dist.rank == 0 else None
            began = broadcast_json(began)
            if "error" in began:
                raise EngineError(began["error"])
            metrics["weight_sync/begin_seconds"] = time.perf_counter() - moved
            moved = time.perf_counter()
        two_sided = self.settings.datapath == "torch"
        receives = self._rank0().start_receives(plan, version) if dist.rank == 0 and two_sided else []
        outcome = await self._send_all(routes, sources)
        sent = time.perf_counter()
        outcomes = all_gather_json(
            {
                "errors": {str(e): f"trainer rank {dist.rank}: {m}" for e, m in outcome.errors.items()},
                "written": {str(e): ids for e, ids in outcome.written.items()},
            }
        )
        if dist.rank == 0 and not two_sided:
            receives = self._rank0().start_receives(plan, version)
        decision = await self._rank0().finish(plan, version, outcomes, receives, metrics) if dist.rank == 0 else None
        decision = broadcast_json(decision)
        if "error" in decision:
            raise EngineError(decision["error"])
        served = time.perf_counter()
        report = PushReport(version=version, num_tensors=plan.tensors, num_bytes=plan.tensor_bytes)
        if self.settings.verify_slices:
            report.checksums = await self._verify(routes, sources, outcome.checksums, plan, version)
            metrics["weight_sync/slice_check_seconds"] = time.perf_counter() - served
        report.seconds = time.perf_counter() - start
        metrics["weight_sync/served_seconds"] = served - start
        metrics["weight_sync/layout_seconds"] = moved - start - metrics.get("weight_sync/begin_seconds", 0.0)
        metrics["weight_sync/send_seconds"] = sent - moved
        metrics["weight_sync/move_seconds"] = served - moved
        metrics["weight_sync/chunks"] = float(len(plan.routes))
        report.metrics.update(metrics)
        return report

    async def _verify(
        self,
        routes: list[Route],
        sources: list[torch.Tensor],
        written: Mapping[str, str],
        plan: RoutePlan,
        version: str,
    ) -> dict[str, str]:
        """Compare each chunk as served with what its rank sent (``written``: the sender's checksums of the bytes
        it wrote, by :attr:`Route.content`; a chunk without one is cast again); rank 0 returns engine 0's
        per-tensor checksums."""
        import torch

        from miles.training.comm import all_gather_json, broadcast_json
        from miles.transport.verify import tensor_checksum

        dist = self._dist()

        def sums() -> dict[str, str]:
            out: dict[str, str] = {}
            for route, source in zip(routes, sources, strict=True):
                key = route.content
                if key not in out:  # the bytes the sender wrote, checksummed as it wrote them; else cast again
                    out[key] = written.get(key) or tensor_checksum(source, getattr(torch, route.dtype))
            return out

        # the engines checksum what they serve while the trainer ranks checksum what they sent (each on its cores)
        asked = asyncio.ensure_future(self._rank0().checksums()) if dist.rank == 0 else None
        try:
            own = await to_thread(sums)
            expected: dict[str, str] = {}
            for part in all_gather_json(own):
                expected.update(part)
        except BaseException:
            if asked is not None:
                asked.cancel()
            raise
        result: dict[str, Any] | None = None
        full: dict[str, str] = {}
        if asked is not None:
            answers = await asked
            result = {}
            failed = [(url, a) for url, a in zip(self.urls, answers, strict=True) if isinstance(a, BaseException)]
            if failed:  # (an engine died after its commit: every rank raises, none waits in the broadcast)
                url, error = failed[0]
                message = f"p2p transport: engine {url} did not answer the check of version {version}: {error}"
                result = {"error": message, "engine": True}
            for e, (url, answer) in enumerate(zip(self.urls, answers, strict=True)):
                if failed:
                    break
                assert not isinstance(answer, BaseException)
                if str(answer.get("weight_version")) != version:
                    result = {
                        "error": f"engine {url} serves weight version {answer.get('weight_version')!r}, expected {version!r}"
                    }
                    break
                wrong = [r for r in plan.for_engine(e) if answer["chunks"].get(str(r.id)) != expected[r.content]]
                if wrong:
                    result = {
                        "error": f"engine {url}: chunk {wrong[0].describe()} differs from what the trainer sent"
                        + (f" ({len(wrong)} chunks differ)" if len(wrong) > 1 else "")
                    }
                    break
            if not failed:
                first = answers[0]
                assert not isinstance(first, BaseException)
                full = dict(first.get("full", {}))
        result = broadcast_json(result)
        assert result is not None
        if result.get("engine"):
            raise EngineError(result["error"])
        if "error" in result:
            raise WeightVerificationError(f"p2p transport, version {version}: {result['error']}")
        return full

    # -- teardown ------------------------------------------------------------------------------------
    async def _close_sessions(self) -> None:
        if self.sessions is not None:
            await self.sessions.close()
        self.sessions = None
        if self.sender is not None:
            self.sender.close()
        self.sender = None
        self.group = None
        self._store = None
        self.endpoint = None
        self.plan = None
        self.opened = False

    async def _after_failure(self) -> None:
        """After a failed push: drop the sessions (a broken group, a dead engine); the next push reopens."""
        await self._close_sessions()

    async def close(self) -> None:
        await self._close_sessions()
