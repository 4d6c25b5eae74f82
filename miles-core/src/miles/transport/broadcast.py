"""The ``broadcast`` transport: a ``torch.distributed`` group spanning trainer rank 0 and the engines.

Trainer rank 0 is rank 0 of a separate process group (gloo on CPU, NCCL on GPU) built over its own
``TCPStore``; engine ``i`` joins as rank ``1 + i`` through SGLang's ``/init_weights_update_group``. For
each bucket, rank 0 announces names, dtypes and shapes with ``/update_weights_from_distributed`` and
broadcasts the tensors in that order; the engines receive and load them. A last, empty call carries the
new ``weight_version`` (and flushes the prefix cache) once every bucket has arrived. The buckets travel
inside a weight-update session, SGLang's ``/begin_weight_update`` ... ``/end_weight_update`` (SGLang
refuses ``/update_weights_from_distributed`` outside one; the local engine accepts both).

A dead member breaks a group (its collectives would fail or wait for the timeout), so the group always
spans the engines that take control calls *at the push*: when they differ from the group's members, or a
member rejoins (an engine died, a restarted one is back, perhaps at the same URL;
:mod:`miles.rollout.failover`), the surviving engines leave the old group and a new one is formed, on a new
port, before the push. An engine dying *during* a push fails
that push at once (gloo reports the closed connection): rank 0 drops its end of the group, so the members
blocked in a receive fail too instead of waiting for the timeout, and raises :class:`PushFailedError`
naming the engines that failed; the publisher then pushes the whole version again to the engines left
(:class:`~miles.driver.publish.InlinePublisher`). Engines that took part of the failed push stay paused
on it (SGLang loads each bucket as it arrives), so they generate again only with the complete version.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from miles.components import ComponentSettings
from miles.errors import EngineError, SettingsError
from miles.net import host_store
from miles.node_address import node_address
from miles.torch_threads import to_thread
from miles.transport.base import PushReport, WeightTransport, wire_dtype
from miles.transport.verify import tensor_checksum

if TYPE_CHECKING:
    import torch

    from miles.rollout.client import EngineClient
    from miles.settings.model import MilesSettings
    from miles.training.trainer import DistContext, WeightBucket

__all__ = ["BroadcastTransport", "BroadcastTransportSettings", "PushFailedError", "make_process_group"]

log = logging.getLogger(__name__)


class PushFailedError(EngineError):
    """A push failed midway: an engine gave no answer or the group broke. Engines that received part of it
    stay paused on it; the version must be pushed again (or the run stops)."""

    def __init__(self, message: str, *, engines: list[str]) -> None:
        super().__init__(message)
        self.engines = engines
        """The engines whose part of the push failed."""


class BroadcastTransportSettings(ComponentSettings):
    """Settings of the ``broadcast`` transport."""

    master_address: str | None = None
    """Address of the group's store, hosted by trainer rank 0: it must be one every engine reaches. Unset:
    rank 0's node address as its launcher tells it (the ``ray`` launcher: the node's IP;
    ``MILES_NODE_ADDRESS``), else ``127.0.0.1`` (the ``local`` launcher: every engine on this host)."""
    master_port: int = 0
    """Port of the group's store (0: one the OS picks as trainer rank 0 binds it)."""
    group_name: str = "miles_weights"
    """Name of the weight-update group on the engines (with ``secret_group_name``, its first part)."""
    secret_group_name: bool = True
    """Add a random secret of this run to the group's name. The name is sent to each engine only through its
    HTTP API (``/init_weights_update_group``, guarded by the engine's API key) and the group's rendezvous
    keys on the trainer's store live under it (SGLang uses the name the same way), so a process that can
    reach the store's port but was not told the name cannot join the group or receive the weights."""
    timeout: float = 600.0
    """Seconds a collective may take before it fails."""


def make_process_group(
    backend: str,
    *,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: float,
    is_master: bool = False,
    group_name: str = "miles_weights",
    store: Any = None,
) -> Any:
    """A process group independent of the default one (trainer and engine processes each have their own
    default world): a ``TCPStore`` plus ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` built on it. Rank 0 passes
    the ``store`` it hosts (:func:`miles.net.host_store`: bound before its port was handed to anyone); the
    others join the store at ``host:port``.

    The group's keys on the store are laid out as SGLang's ``init_custom_process_group`` lays them out for
    ``/init_weights_update_group`` (a prefix of ``group_name``, then torch's own ``"<group_name>/"`` and
    ``"<device>/"`` prefixes), so an SGLang engine and this function meet in one group. Whoever does not
    know ``group_name`` cannot find the group's keys on the store: a secret in the name keeps other
    processes that reach the port out (:attr:`BroadcastTransportSettings.secret_group_name`)."""
    import torch.distributed as dist

    if store is None:
        store = dist.TCPStore(
            host, port, world_size, is_master, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
    device = "cuda" if backend == "nccl" else "cpu"
    keys = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    if backend == "gloo":
        return dist.ProcessGroupGloo(keys, rank, world_size, timedelta(seconds=timeout)), store
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(keys, rank, world_size, options), store
    raise ValueError(f"unknown backend {backend!r} (expected gloo or nccl)")


def group_ranks(server_infos: list[dict[str, Any]]) -> tuple[list[int], int]:
    """Each engine's ``rank_offset`` in the weight-update group and the group's size, from the engines'
    ``/server_info``: trainer rank 0 is rank 0, and an SGLang engine of ``tp_size`` T joins as ranks
    ``rank_offset`` .. ``rank_offset + T - 1`` (one per TP rank; an engine without ``tp_size`` takes one)."""
    tp_sizes = [max(1, int(info.get("tp_size") or 1)) for info in server_infos]
    return [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))], 1 + sum(tp_sizes)


def run_in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future[Any]:
    """Run ``fn`` in a daemon thread; the returned future resolves on the running loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name="miles-weights-rendezvous", daemon=True).start()
    return future


def broadcast_tensors(group: Any, tensors: list[torch.Tensor], *, src: int = 0) -> None:
    """Broadcast ``tensors`` in order over ``group`` (blocking)."""
    import torch
    import torch.distributed as dist

    for tensor in tensors:
        if tensor.element_size() == 1 and tensor.dtype not in (torch.uint8, torch.int8, torch.bool):
            tensor = tensor.view(torch.uint8)  # gloo has no float8 types: the same bytes (a view: filled in place)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        group.broadcast([tensor], opts).wait()


class BroadcastTransport(WeightTransport[BroadcastTransportSettings]):
    """Pushes weights over a process group that spans trainer rank 0 and every engine."""

    name = "broadcast"

    @classmethod
    def check_settings(cls, options: BroadcastTransportSettings, settings: MilesSettings) -> None:
        """Refuse colocation on CUDA: the group would put trainer rank 0 and engine 0 on one GPU, and NCCL
        refuses two ranks of a group on one device."""
        if settings.cluster.colocate and settings.cluster.device == "cuda":
            raise SettingsError(
                "transport.name: 'broadcast' cannot serve cluster.colocate = true on CUDA (trainer rank 0 and "
                "engine 0 would be two NCCL ranks on one GPU, which NCCL refuses); colocated engines take their "
                "weights by CUDA IPC (transport 'tensor_ipc', 'sglang_tensor' with SGLang) or from disk ('disk')"
            )

    def __init__(
        self, settings: BroadcastTransportSettings, *, run_dir: str, model_path: str | None, engine_dtype: str
    ) -> None:
        super().__init__(settings, run_dir=run_dir, model_path=model_path, engine_dtype=engine_dtype)
        self.options = settings
        self.client: EngineClient | None = None
        self.group: Any = None
        self._store: Any = None
        self.device = "cpu"
        self.group_name = settings.group_name
        """The group's name on the engines (``group_name`` plus the run's secret)."""
        self.members: list[str] = []
        """The engines of the current group, rank ``1 + i`` for ``members[i]``."""
        self._dist: DistContext | None = None

    @property
    def master_address(self) -> str:
        """Where the engines reach the group's store: :attr:`BroadcastTransportSettings.master_address`, or
        this process's (trainer rank 0's) node address, :func:`miles.node_address.node_address`."""
        return self.options.master_address or node_address()

    async def connect(self, client: EngineClient | None, dist: DistContext) -> None:
        if dist.rank != 0:
            return
        if client is None:
            raise RuntimeError("broadcast transport: rank 0 needs the engine client")
        self.client = client
        self._dist = dist
        self.device = dist.device
        backend = "nccl" if dist.device == "cuda" else "gloo"
        # the store binds before its port is told to anyone (port 0: the OS picks one, nobody can take it first)
        master = self.master_address
        store, port = host_store(master, self.options.master_port, timeout=self.options.timeout)
        members = list(client.urls)
        offsets, world_size = group_ranks(await client.server_info())
        self.group_name = self.options.group_name
        if self.options.secret_group_name:
            self.group_name += "-" + secrets.token_hex(16)
        joins = [
            asyncio.create_task(
                client.call(
                    url,
                    "/init_weights_update_group",
                    {
                        "master_address": master,
                        "master_port": port,
                        "rank_offset": offsets[i],
                        "world_size": world_size,
                        "group_name": self.group_name,
                        "backend": backend,
                    },
                )
            )
            for i, url in enumerate(members)
        ]
        # the rendezvous blocks until every engine joins; if an engine refuses, fail now, not at the timeout
        # (a daemon thread: a rendezvous left waiting must not keep the process alive)
        rendezvous = run_in_daemon_thread(
            lambda: make_process_group(
                backend,
                host=master,
                port=port,
                rank=0,
                world_size=world_size,
                timeout=self.options.timeout,
                group_name=self.group_name,
                store=store,
            )
        )
        pending: set[asyncio.Future[Any]] = {rendezvous, *joins}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    for other in pending:
                        other.cancel()
                    raise task.exception()  # type: ignore[misc]
        self.group, self._store = rendezvous.result()
        self.members = members
        log.info(
            "broadcast transport: group %r with %d engines at %s:%d",
            self.options.group_name,
            world_size - 1,
            master,
            port,
        )

    async def push(self, buckets: Iterable[WeightBucket], *, version: str, dist: DistContext) -> PushReport:
        import torch

        start = time.perf_counter()
        report = PushReport(version=version)
        dtype = getattr(torch, self.engine_dtype)
        if dist.rank == 0:
            await self._regroup_if_changed()
            await self._on_engines("/begin_weight_update", {})
        for bucket in buckets:
            if dist.rank != 0 or not bucket:
                continue
            if self.client is None or self.group is None:
                raise RuntimeError("broadcast transport: push before connect()")
            tensors = [t.detach().to(wire_dtype(n, t, dtype)).to(self.device).contiguous() for n, t in bucket]
            names = [name for name, _ in bucket]
            payload = {
                "names": names,
                "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "shapes": [list(t.shape) for t in tensors],
                "group_name": self.group_name,
                "flush_cache": False,
            }
            await self._send_bucket(tensors, payload, version)
            for name, t in zip(names, tensors, strict=True):
                report.checksums[name] = tensor_checksum(t)
                report.num_bytes += t.numel() * t.element_size()
            report.num_tensors += len(tensors)
        if dist.rank == 0:
            assert self.client is not None
            closing = {
                "names": [],
                "dtypes": [],
                "shapes": [],
                "group_name": self.group_name,
                "flush_cache": True,
                "weight_version": version,
            }
            await self._on_engines("/update_weights_from_distributed", closing)
            await self._on_engines("/end_weight_update", {})
            report.seconds = time.perf_counter() - start
        return report

    async def _send_bucket(self, tensors: list[torch.Tensor], payload: dict[str, Any], version: str) -> None:
        """Rank 0: announce one bucket to every member and broadcast it; a failure drops the group (see the
        module docstring) and raises :class:`PushFailedError`."""
        assert self.client is not None
        client = self.client
        receives = [
            asyncio.create_task(client.call(url, "/update_weights_from_distributed", payload)) for url in self.members
        ]
        cause: Exception | None = None
        try:
            await to_thread(broadcast_tensors, self.group, tensors)
        except Exception as exc:
            # members blocked in this bucket's receive wait for tensors that will not come: closing rank 0's end
            # of the group fails their receive now (gloo: "connection closed by peer") instead of at the timeout
            traceback.clear_frames(exc.__traceback__)  # (its frames hold the group)
            self._drop_group()
            cause = exc
        answers = await asyncio.gather(*receives, return_exceptions=True)
        errors = [(url, a) for url, a in zip(self.members, answers, strict=True) if isinstance(a, BaseException)]
        if cause is None and not errors:
            return
        self._drop_group()
        raise PushFailedError(
            f"broadcast transport: the push of weight version {version} failed midway"
            + (f" ({cause})" if cause is not None else "")
            + ": "
            + ("; ".join(f"{url}: {a}" for url, a in errors) or "every engine answered"),
            engines=[url for url, _ in errors],
        ) from cause

    def _drop_group(self) -> None:
        """Close rank 0's end of a broken group: only freeing it closes its connections (``abort`` does not).
        The members stay recorded, so :meth:`close` still has them leave it."""
        self.group = None
        self._store = None
        gc.collect()

    async def _on_engines(self, endpoint: str, payload: dict[str, Any]) -> None:
        """POST ``payload`` to ``endpoint`` of every engine at once (rank 0)."""
        if self.client is None:
            raise RuntimeError("broadcast transport: push before connect()")
        client = self.client
        await asyncio.gather(*(client.call(url, endpoint, payload) for url in self.members))

    async def _regroup_if_changed(self) -> None:
        """Rank 0: form a new group when the engines that take control calls are not the group's members."""
        assert self.client is not None and self._dist is not None
        rejoining = [url for url in self.client.rejoining() if url in self.members]
        if self.group is not None and list(self.client.urls) == self.members and not rejoining:
            return
        if self.group is None:
            log.warning("broadcast transport: the last push broke the group; forming a new one")
        elif rejoining:  # back at the same URL: a restarted engine is in no group
            log.warning("broadcast transport: %s rejoin(s); forming a new group", ", ".join(rejoining))
        else:
            log.warning(
                "broadcast transport: the engines changed (%s -> %s); forming a new group",
                ", ".join(self.members),
                ", ".join(self.client.urls),
            )
        await self.close()
        await self.connect(self.client, self._dist)

    async def close(self) -> None:
        if self.client is not None and self.members:
            reachable = set(self.client.urls)
            await asyncio.gather(
                *(
                    self.client.call(url, "/destroy_weights_update_group", {"group_name": self.group_name})
                    for url in self.members
                    if url in reachable
                ),
                return_exceptions=True,
            )
        self.group = None
        self._store = None
        self.members = []
