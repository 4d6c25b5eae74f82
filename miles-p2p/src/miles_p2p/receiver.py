"""Engine side of point-to-point weight updates (the ``p2p`` transport): the sessions behind the local
engine's ``/p2p/*`` routes (:mod:`miles_p2p.routes`).

A **session** is opened once per transport: it names a data path and sets it up (joins a process group,
starts a Mooncake Transfer Engine, or nothing for shared memory). A **plan** lists the chunks this engine
receives: each chunk is one trainer rank's slice of one tensor (a box of offsets and shape), placed at a
byte offset of one receive buffer that the session allocates (and registers with Mooncake) once per plan.
A push then fills the buffer — the trainer ranks write into it (Mooncake, shared memory) or the engine
receives into it (``torch.distributed``) while the engine keeps generating — and a **commit** copies each
chunk into its parameter box, on the scheduler thread, between forward passes. The engine's parameters
change only at the commit, so a push that fails on another engine leaves this one serving its version.

Data paths (``datapath`` of ``/p2p/open_session``):

- ``torch``: a process group (gloo on CPU, NCCL on GPU) of the trainer ranks and the engines, built over
  the trainer's ``TCPStore``; each chunk is one ``send`` / ``recv`` pair, tagged with its id.
- ``mooncake``: a Mooncake Transfer Engine in this process (``mooncake-transfer-engine``; TCP, or RDMA on
  a cluster) with the buffer registered; trainer ranks write into it remotely.
- ``shm``: the buffer is a file in ``/dev/shm`` that the trainer created on this host; trainer ranks write
  into it and the engines sharing it copy from it (one write for all the engines of a host). With direct
  writes there is no buffer: the engine moves its weight storages to shared memory (in place, as
  ``torch.multiprocessing`` shares tensors) and the trainer ranks write into them while generation is
  paused (``/p2p/begin``): one copy instead of two, but a push that fails midway leaves the engine paused
  on partial weights instead of serving its previous version.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from miles.engine.faults import die_in_push_if_asked
from miles_p2p.endpoint import MooncakeEndpoint, host_id

__all__ = ["Chunk", "P2PSession"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chunk:
    """One trainer rank's slice of one tensor, as this engine receives it."""

    id: int
    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    src: int
    """The trainer rank that sends it."""
    offset: int
    """Byte offset in the receive buffer."""
    nbytes: int

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> Chunk:
        try:
            return cls(
                id=int(raw["id"]),
                name=str(raw["name"]),
                offsets=tuple(int(x) for x in raw["offsets"]),
                shape=tuple(int(x) for x in raw["shape"]),
                src=int(raw["src"]),
                offset=int(raw["offset"]),
                nbytes=int(raw["nbytes"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"chunks: malformed chunk {raw!r}: {exc}") from None

    def describe(self) -> str:
        box = ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.shape, strict=True))
        return f"{self.name!r}[{box}] from trainer rank {self.src}"

    def box(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.shape, strict=True))


class _Buffer:
    """A receive buffer: heap memory of this process, or a shared-memory file the trainer created."""

    def __init__(self, nbytes: int, *, device: torch.device, shared_path: str | None) -> None:
        self.path = shared_path
        if shared_path is None:
            self.tensor = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=device)  # faulted in once
            return
        if os.path.dirname(os.path.realpath(shared_path)) != "/dev/shm":
            raise ValueError(f"buffer_path: {shared_path!r} is not a file in /dev/shm")
        try:
            fd = os.open(shared_path, os.O_RDWR)
        except OSError as exc:
            raise ValueError(
                f"buffer_path: cannot open {shared_path} on this host ({exc}); shm needs one host"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ValueError(f"buffer_path: {shared_path} has {size} bytes, the plan needs {nbytes}")
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(mapped, dtype=torch.uint8)

    def close(self) -> None:
        # the file belongs to the trainer; the map goes when no tensor views it any more
        self.tensor = torch.empty(0, dtype=torch.uint8)


class P2PSession:
    """One transport's session on this engine (see the module docstring)."""

    def __init__(self, session_id: str, datapath: str, body: dict[str, Any], device: torch.device) -> None:
        if datapath not in ("torch", "mooncake", "shm"):
            raise ValueError(f"datapath: {datapath!r} is not one of torch, mooncake, shm")
        self.id = session_id
        self.datapath = datapath
        self.device = device
        self.group: Any = None
        self.store: Any = None
        self.endpoint: MooncakeEndpoint | None = None
        self.rank = -1
        self.timeout = float(body.get("timeout", 600.0))
        self.plan_id: str | None = None
        self.chunks: list[Chunk] = []
        self.buffer: _Buffer | None = None
        self.received: str | None = None
        """The version whose chunks have all arrived (``torch`` data path), until commit or abort."""
        self.broken: str | None = None
        self.direct = False
        """``shm`` with direct writes: the trainer ranks write into the weights themselves (no buffer)."""
        self.regions: list[tuple[torch.UntypedStorage, int, int, int]] = []
        """Direct writes: the shared weight storages (storage, its fd, bytes, data pointer)."""
        self.writing: str | None = None
        """Direct writes: the version being written (generation paused) until commit or abort."""
        self.paused_by_begin = False
        self.after_partial = False
        """Direct writes: generation was already paused on the partial weights of an earlier write that
        stopped midway when this one began (an abort keeps it paused even if nothing was written)."""
        if datapath == "torch":
            from miles.transport.broadcast import make_process_group

            backend = str(body.get("backend", "gloo"))
            if backend not in ("gloo", "nccl"):
                raise ValueError(f"backend: {backend!r} is not supported (gloo or nccl)")
            self.rank = int(body["rank"])
            self.group, self.store = make_process_group(
                backend,
                host=str(body["master_address"]),
                port=int(body["master_port"]),
                rank=self.rank,
                world_size=int(body["world_size"]),
                timeout=self.timeout,
                is_master=False,
            )
        elif datapath == "mooncake":
            self.endpoint = MooncakeEndpoint(
                str(body.get("hostname", "127.0.0.1")),
                protocol=str(body.get("protocol", "tcp")),
                device_name=str(body.get("device_name", "")),
            )

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"session_id": self.id, "datapath": self.datapath, "host_id": host_id()}
        if self.endpoint is not None:
            out["mooncake_session"] = self.endpoint.session
        return out

    # -- plan ----------------------------------------------------------------------------------------
    def set_plan(
        self,
        plan_id: str,
        chunks: list[Chunk],
        params: dict[str, torch.nn.Parameter],
        buffer_path: str | None = None,
        direct: bool = False,
    ) -> dict[str, Any]:
        """Check ``chunks`` against the served parameters and allocate the buffer they fill (``shm``: map
        the trainer's file ``buffer_path``; ``direct``: share the weights themselves instead)."""
        unique: dict[int, tuple[str, torch.nn.Parameter]] = {}
        for name, p in params.items():  # canonical names come first; tied aliases share the object
            unique.setdefault(id(p), (name, p))
        covered: dict[int, int] = {}
        boxes: dict[int, list[Chunk]] = {}
        end = 0
        for chunk in sorted(chunks, key=lambda c: c.offset):
            target = params.get(chunk.name)
            if target is None:
                raise ValueError(f"plan: the engine serves no parameter {chunk.name!r}")
            if len(chunk.offsets) != target.dim() or len(chunk.shape) != target.dim():
                raise ValueError(
                    f"plan: chunk {chunk.describe()} has {len(chunk.shape)} dims, the parameter {target.dim()}"
                )
            for o, n, size in zip(chunk.offsets, chunk.shape, target.shape, strict=True):
                if o < 0 or n < 0 or o + n > size:
                    raise ValueError(f"plan: chunk {chunk.describe()} lies outside {tuple(target.shape)}")
            numel = 1
            for n in chunk.shape:
                numel *= n
            if chunk.nbytes != numel * target.element_size():
                raise ValueError(
                    f"plan: chunk {chunk.describe()} has {chunk.nbytes} bytes, expected {numel * target.element_size()}"
                )
            if chunk.offset < end or chunk.offset % target.element_size():
                raise ValueError(f"plan: chunk {chunk.describe()} overlaps another or is misaligned at {chunk.offset}")
            end = chunk.offset + chunk.nbytes
            for other in boxes.setdefault(id(target), []):
                if all(
                    a < b + m and b < a + n
                    for a, n, b, m in zip(chunk.offsets, chunk.shape, other.offsets, other.shape, strict=True)
                ):
                    raise ValueError(f"plan: chunks {chunk.describe()} and {other.describe()} overlap")
            boxes[id(target)].append(chunk)
            covered[id(target)] = covered.get(id(target), 0) + numel
        for key, (name, p) in unique.items():
            if covered.get(key, 0) != p.numel():  # disjoint boxes inside the tensor: equal counts = a cover
                raise ValueError(f"plan: no chunk updates (all of) parameter {name!r}")
        if direct:
            if self.datapath != "shm":
                raise ValueError(f"direct writes need the shm data path, not {self.datapath}")
            self.release_buffer()
            places = self._share_weights(chunks, params)
            self.plan_id, self.chunks, self.received, self.direct = plan_id, list(chunks), None, True
            regions = [{"path": f"/proc/{os.getpid()}/fd/{fd}", "bytes": size} for _, fd, size, _ in self.regions]
            return {"plan_id": plan_id, "buffer_bytes": 0, "regions": regions, "places": places}
        if self.datapath == "shm" and not buffer_path:
            raise ValueError("buffer_path is required with the shm data path")
        self.release_buffer()
        on_host = self.datapath in ("mooncake", "shm")
        self.buffer = _Buffer(
            end,
            device=torch.device("cpu") if on_host else self.device,
            shared_path=buffer_path if self.datapath == "shm" else None,
        )
        self.plan_id, self.chunks, self.received = plan_id, list(chunks), None
        out: dict[str, Any] = {"plan_id": plan_id, "buffer_bytes": end}
        if self.endpoint is not None:
            out["buffer_address"] = self.endpoint.register(self.buffer.tensor)
            out["mooncake_session"] = self.endpoint.session
        if self.buffer.path is not None:
            out["buffer_path"] = self.buffer.path
        return out

    def _share_weights(self, chunks: list[Chunk], params: dict[str, torch.nn.Parameter]) -> dict[str, list[int]]:
        """Move the weight storages the chunks land in to shared memory (in place: every view of them,
        fused matrices included, follows) and say where each chunk lies: ``{id: [region, byte offset]}``."""
        index: dict[int, int] = {}
        for chunk in chunks:
            target = params[chunk.name]
            if target.device.type != "cpu":
                raise ValueError("direct writes need the engine's weights in CPU memory")
            if not target[chunk.box()].is_contiguous():
                raise ValueError(
                    f"chunk {chunk.describe()} is not contiguous in the engine's memory (use staged commits)"
                )
            storage = target.untyped_storage()
            if storage._cdata not in index:
                storage.share_memory_()  # torch.multiprocessing's own mechanism: same storage, new shm pages
                fd, size = storage._share_fd_cpu_()
                index[storage._cdata] = len(self.regions)
                self.regions.append((storage, int(fd), int(size), storage.data_ptr()))
        places = {}
        for chunk in chunks:
            target = params[chunk.name]
            region = index[target.untyped_storage()._cdata]
            places[str(chunk.id)] = [region, target[chunk.box()].data_ptr() - self.regions[region][3]]
        return places

    def begin(self, plan_id: str, version: str, params: dict[str, torch.nn.Parameter]) -> None:
        """Direct writes: the trainer ranks may write ``version`` now (the caller paused generation)."""
        self._check_direct(plan_id)
        shared = {storage._cdata: ptr for storage, _, _, ptr in self.regions}
        for chunk in self.chunks:
            storage = params[chunk.name].untyped_storage()
            if shared.get(storage._cdata) != storage.data_ptr():
                raise RuntimeError(
                    f"parameter {chunk.name!r} no longer lies in the shared weights (a memory release moved it): "
                    "open a new session"
                )
        self.writing = version

    def _check_direct(self, plan_id: str) -> None:
        if self.plan_id != plan_id or not self.direct:
            raise ValueError(f"plan_id {plan_id!r} is not this session's direct-write plan ({self.plan_id!r})")

    def _check_plan(self, plan_id: str) -> _Buffer:
        if self.broken is not None:
            raise RuntimeError(f"session {self.id!r} is unusable after an earlier failure: {self.broken}")
        if self.plan_id != plan_id or self.buffer is None:
            raise ValueError(f"plan_id {plan_id!r} is not this session's plan ({self.plan_id!r})")
        return self.buffer

    # -- a push ----------------------------------------------------------------------------------------
    def receive(self, plan_id: str, version: str) -> float:
        """The first phase of a push: ``torch``: receive every chunk into the buffer (blocking, off the
        scheduler thread); one-sided data paths: the trainer ranks have written it, this engine is ready.

        A chunk that does not arrive within the session's timeout fails the receive, naming it; the group
        is unusable afterwards (the transport opens a new session)."""
        if self.direct:  # written into the weights: this engine is alive and was paused for it
            self._check_direct(plan_id)
            if self.writing != version:
                raise ValueError(f"version {version!r} is not being written (writing: {self.writing!r})")
            return 0.0
        buffer = self._check_plan(plan_id)
        start = time.perf_counter()
        self.received = None
        if self.datapath != "torch":  # the trainer ranks wrote into the buffer: this engine is ready
            die_in_push_if_asked(2, unit="confirmation (every chunk written, none committed)")
            self.received = version
            return 0.0
        works = [
            (c, self.group.recv([buffer.tensor[c.offset : c.offset + c.nbytes]], c.src, c.id)) for c in self.chunks
        ]
        deadline = time.monotonic() + self.timeout
        missing: list[Chunk] = []
        error = ""
        for i, (chunk, work) in enumerate(works):  # after the first timeout the rest are only polled
            try:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except Exception as exc:
                missing.append(chunk)
                error = error or f"{type(exc).__name__}: {exc}"
                deadline = time.monotonic()
            else:
                die_in_push_if_asked(i + 2, unit="chunk")  # (chunk 1 is in)
        if missing:
            self.broken = f"receiving version {version}: {len(missing)} chunk(s) never arrived"
            raise RuntimeError(
                f"receiving version {version}: {len(missing)} chunk(s) never arrived, e.g. {missing[0].describe()} "
                f"({error})"
            )
        if buffer.tensor.device.type == "cuda":
            torch.cuda.synchronize(buffer.tensor.device)
        self.received = version
        return time.perf_counter() - start

    @torch.no_grad()
    def commit(
        self, plan_id: str, version: str, params: dict[str, torch.nn.Parameter], written: list[int] | None
    ) -> int:
        """Copy every chunk into its parameter box (the scheduler thread, generation paused).

        :param written: the chunk ids the trainer ranks wrote in this push (one-sided data paths); a
            chunk of the plan missing from it fails the commit before any parameter changes.
        """
        if self.direct:
            self._check_direct(plan_id)
            if self.writing != version:
                raise ValueError(f"version {version!r} is not being written (writing: {self.writing!r})")
            self._check_written(written)
            self.writing = None
            return len(self.chunks)
        buffer = self._check_plan(plan_id)
        if self.received != version:
            raise ValueError(f"version {version!r} has not been received (received: {self.received!r})")
        self._check_written(written)
        for chunk in self.chunks:
            target = params[chunk.name]
            source = buffer.tensor[chunk.offset : chunk.offset + chunk.nbytes].view(target.dtype).view(chunk.shape)
            target[chunk.box()].copy_(source)
        self.received = None
        return len(self.chunks)

    def _check_written(self, written: list[int] | None) -> None:
        if written is not None:
            sent = set(written)
            missing = [c for c in self.chunks if c.id not in sent]
            if missing:
                raise ValueError(
                    f"{len(missing)} chunk(s) of the plan were not sent in this push, e.g. {missing[0].describe()}"
                )

    def chunk_checksums(self, params: dict[str, torch.nn.Parameter]) -> dict[str, str]:
        """XXH3-128 (as :func:`~miles.transport.verify.tensor_checksum`) of each chunk's box of what is served."""
        from miles.transport.verify import tensor_checksum

        return {str(c.id): tensor_checksum(params[c.name][c.box()]) for c in self.chunks}

    def full_checksums(self, model: torch.nn.Module, chunk_sums: dict[str, str]) -> dict[str, str]:
        """Each parameter's checksum (``/weights_checksum``'s), taken from ``chunk_sums`` (of
        :meth:`chunk_checksums`) where one chunk is the whole tensor: the same bytes and shape."""
        from miles.transport.verify import tensor_checksum

        params = dict(model.named_parameters())
        whole = {
            c.name: chunk_sums[str(c.id)]
            for c in self.chunks
            if c.name in params and not any(c.offsets) and tuple(c.shape) == tuple(params[c.name].shape)
        }
        return {name: whole.get(name) or tensor_checksum(p) for name, p in params.items()}

    def randomize(self, seed: int) -> None:
        """Random bytes in the receive buffer (test mode: a chunk the trainer skips cannot pass as sent)."""
        if self.buffer is not None and self.buffer.tensor.numel():
            generator = torch.Generator().manual_seed(seed)
            noise = torch.randint(0, 256, (self.buffer.tensor.numel(),), dtype=torch.uint8, generator=generator)
            self.buffer.tensor.copy_(noise)
        self.received = None

    def release_buffer(self) -> None:
        if self.endpoint is not None:
            self.endpoint.unregister_all()
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        self.regions = []  # shared weights stay shared (the storages are the model's)
        self.direct, self.writing = False, None
        self.plan_id = None

    def close(self) -> None:
        self.release_buffer()
        self.group = None
        self.store = None
        self.endpoint = None
