"""The trainer side of the three data paths: how one rank's chunks reach the engines' receive buffers.

- :class:`TorchSender`: ``ProcessGroup.send`` of each chunk (gloo on CPU, NCCL on GPU) to the engine's
  rank in the transport's process group, tagged with the chunk id; the engine posts the matching receives.
- :class:`MooncakeSender`: this rank's chunks are cast into one registered send buffer, then written into
  each engine's registered receive buffer with one Mooncake batch write per engine.
- :class:`ShmSender`: the receive buffer is a ``/dev/shm`` file (one per group of engines with the same
  plan on this host, created by rank 0); each rank maps it and casts its chunks straight into it, once
  for all the engines that share it.

A send returns, per engine index, the error that stopped it (other engines are still served) and the ids
of the chunks written; it never raises for an engine's failure. The senders that cast chunks into memory of
this host (shm, Mooncake) checksum each chunk right after writing it, while it is in cache, when
``checksum_written`` is set (the transport's slice check then compares the engines' chunks with those
instead of casting every source again: on SmolLM2 ~40 ms of casts a push, against ~10 of checksums).
"""

from __future__ import annotations

import logging
import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles.transport.verify import tensor_checksum

if TYPE_CHECKING:
    import torch

    from miles_p2p.endpoint import MooncakeEndpoint
    from miles_p2p.plan import Route

__all__ = ["MooncakeSender", "Outcome", "Sender", "ShmSender", "TorchSender", "map_shared"]

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What one rank's send did, per engine index."""

    errors: dict[int, str]
    written: dict[int, list[int]]
    checksums: dict[str, str] = field(default_factory=dict)
    """``Route.content`` -> checksum of the bytes written for it (senders with ``checksum_written``)."""

    @classmethod
    def merged(cls, parts: Sequence[Outcome]) -> Outcome:
        """The outcome of one send made of the sends of ``parts`` (each its share of the routes)."""
        out = cls(errors={}, written={})
        for part in parts:
            for e, message in part.errors.items():
                out.errors.setdefault(e, message)
            for e, ids in part.written.items():
                out.written.setdefault(e, []).extend(ids)
            out.checksums.update(part.checksums)
        return out


def _dtype(route: Route) -> torch.dtype:
    import torch

    dtype: torch.dtype = getattr(torch, route.dtype)
    return dtype


def _cast(route: Route, source: torch.Tensor) -> torch.Tensor:
    return source.to(_dtype(route)).contiguous()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.reshape(-1).view(torch.uint8)


class Sender(ABC):
    """One rank's sending side of a data path (sync: the transport runs it in a worker thread)."""

    checksum_written = False
    """Checksum each chunk as written into this host's memory (:attr:`Outcome.checksums`), where the data
    path writes it there."""
    concurrent = False
    """Whether :meth:`send` may run on several threads at once, each with its share of the routes."""

    def prepare(self, routes: Sequence[Route], plan_answers: list[dict[str, Any]]) -> None:
        """Once per plan: ``routes`` are this rank's, ``plan_answers`` each engine's ``/p2p/plan`` answer."""

    @abstractmethod
    def send(self, routes: Sequence[Route], sources: Sequence[torch.Tensor]) -> Outcome:
        """Deliver ``sources[i]`` (a view of this rank's slice) as chunk ``routes[i]``."""

    def close(self) -> None:
        """Release what :meth:`prepare` set up."""


class TorchSender(Sender):
    """Point-to-point sends over the transport's process group (engine ``e`` is rank ``engine_rank0 + e``)."""

    def __init__(self, group: Any, engine_rank0: int) -> None:
        self.group = group
        self.engine_rank0 = engine_rank0

    def send(self, routes: Sequence[Route], sources: Sequence[torch.Tensor]) -> Outcome:
        outcome = Outcome(errors={}, written={})
        pending: list[tuple[Route, Any, torch.Tensor]] = []
        for route, source in zip(routes, sources, strict=True):
            if route.engine in outcome.errors:
                continue
            data = _bytes(_cast(route, source))
            try:
                work = self.group.send([data], self.engine_rank0 + route.engine, route.id)
            except Exception as exc:  # a dead peer: that engine only
                outcome.errors[route.engine] = f"{type(exc).__name__}: {exc}"
                continue
            pending.append((route, work, data))
        for route, work, _ in pending:
            if route.engine in outcome.errors:
                continue
            try:
                work.wait()
            except Exception as exc:
                outcome.errors[route.engine] = f"{type(exc).__name__}: {exc}"
                continue
            outcome.written.setdefault(route.engine, []).append(route.id)
        return outcome


class MooncakeSender(Sender):
    """Mooncake Transfer Engine writes from one registered send buffer of this rank."""

    def __init__(self, endpoint: MooncakeEndpoint) -> None:
        self.endpoint = endpoint
        self.arena: torch.Tensor | None = None
        self.places: dict[tuple[str, tuple[int, ...]], int] = {}
        self.targets: list[tuple[str, int]] = []

    def prepare(self, routes: Sequence[Route], plan_answers: list[dict[str, Any]]) -> None:
        import torch

        self.close()
        size = 0
        for route in routes:
            key = (route.name, route.offsets)
            if key not in self.places:
                size = -(-size // 64) * 64
                self.places[key] = size
                size += route.nbytes
        self.arena = torch.zeros(max(size, 1), dtype=torch.uint8)
        self.endpoint.register(self.arena)
        self.targets = [(str(a["mooncake_session"]), int(a["buffer_address"])) for a in plan_answers]

    def send(self, routes: Sequence[Route], sources: Sequence[torch.Tensor]) -> Outcome:
        assert self.arena is not None
        outcome = Outcome(errors={}, written={})
        filled: set[tuple[str, tuple[int, ...]]] = set()
        base = int(self.arena.data_ptr())
        by_engine: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}
        for route, source in zip(routes, sources, strict=True):
            key = (route.name, route.offsets)
            at = self.places[key]
            if key not in filled:
                view = self.arena[at : at + route.nbytes].view(_dtype(route)).view(route.shape)
                view.copy_(source)  # cast and copy in one pass
                if self.checksum_written:
                    outcome.checksums[route.content] = tensor_checksum(view)
                filled.add(key)
            srcs, dsts, lens, ids = by_engine.setdefault(route.engine, ([], [], [], []))
            srcs.append(base + at)
            dsts.append(self.targets[route.engine][1] + route.offset)
            lens.append(route.nbytes)
            ids.append(route.id)
        for engine, (srcs, dsts, lens, ids) in by_engine.items():
            try:
                self.endpoint.write(self.targets[engine][0], srcs, dsts, lens)
            except Exception as exc:
                outcome.errors[engine] = f"{type(exc).__name__}: {exc}"
                continue
            outcome.written[engine] = ids
        return outcome

    def close(self) -> None:
        self.endpoint.unregister_all()
        self.arena = None
        self.places = {}


def map_shared(path: str, nbytes: int) -> torch.Tensor:
    """A ``/dev/shm`` file as a writable uint8 tensor (``MAP_SHARED``: every process sees the writes)."""
    import torch

    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"{path}: {size} bytes, the plan needs {nbytes}")
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)


class ShmSender(Sender):
    """Casts chunks straight into shared memory on this host: the receive buffers (one per group of engines
    with the same plan), or with ``direct`` the engines' weights themselves. Each chunk's place is its own, so
    shares of the routes may be sent on several threads at once (:attr:`concurrent`)."""

    concurrent = True

    def __init__(self, *, direct: bool = False) -> None:
        self.direct = direct
        self.buffers: list[torch.Tensor] = []
        self.shared_with: list[int] = []
        """Per engine, the first engine with the same buffer (each buffer is written once)."""
        self.places: list[dict[str, list[int]]] = []
        self.regions: list[list[torch.Tensor]] = []

    def prepare(self, routes: Sequence[Route], plan_answers: list[dict[str, Any]]) -> None:
        self.close()
        if self.direct:
            for answer in plan_answers:
                self.regions.append([map_shared(str(r["path"]), int(r["bytes"])) for r in answer["regions"]])
                self.places.append({str(k): [int(x) for x in v] for k, v in answer["places"].items()})
            return
        paths: dict[str, int] = {}
        for e, answer in enumerate(plan_answers):
            path = str(answer["buffer_path"])
            if path not in paths:
                paths[path] = e
                self.buffers.append(map_shared(path, int(answer["buffer_bytes"])))
            else:
                self.buffers.append(self.buffers[paths[path]])
            self.shared_with.append(paths[path])

    def _target(self, route: Route) -> torch.Tensor | None:
        if self.direct:
            region, offset = self.places[route.engine][str(route.id)]
            return self.regions[route.engine][region][offset : offset + route.nbytes]
        if self.shared_with[route.engine] != route.engine:
            return None  # written with the engine that shares the buffer
        return self.buffers[route.engine][route.offset : route.offset + route.nbytes]

    def send(self, routes: Sequence[Route], sources: Sequence[torch.Tensor]) -> Outcome:
        outcome = Outcome(errors={}, written={})
        for route, source in zip(routes, sources, strict=True):
            target = self._target(route)
            if target is not None:
                view = target.view(_dtype(route)).view(route.shape)
                view.copy_(source)  # cast and copy in one pass
                if self.checksum_written and route.content not in outcome.checksums:
                    outcome.checksums[route.content] = tensor_checksum(view)
            outcome.written.setdefault(route.engine, []).append(route.id)
        return outcome

    def close(self) -> None:
        self.buffers = []
        self.shared_with = []
        self.places = []
        self.regions = []
