"""The ``disk_delta`` transport: only what changed since the last push goes to storage, as compressed XOR.

For engines that share storage with the trainer but no network group. Trainer rank 0 keeps the last
pushed version in the engine dtype. Each push writes, atomically (:func:`~miles.transport.files.atomic_directory`):

- a **delta** folder ``delta-v<N>``: the changed tensors as XOR against version ``N-1``, zstd-compressed
  (:mod:`~miles.transport.delta_codec`), unchanged tensors only named, and a manifest with the checksum
  every tensor must have once the delta is applied (:mod:`~miles.transport.manifest`);
- a **full** snapshot ``full-v<N>`` (safetensors plus the model's config and tokenizer files, a normal
  Hugging Face folder) when an engine needs one: on the first push, for an engine this transport has not
  delivered to yet (a new or restarted engine), for an engine that refused the delta (it serves another
  base version, or a tensor failed its checksum: the engine rolled the delta back), and every
  ``full_every`` pushes.

Engines load a folder with ``/update_weights_from_delta`` (:mod:`miles.engine.weight_delta`): they check
the manifest's base version against the one they serve, apply in place and verify every tensor's checksum
before the new version is served. ``stage`` / ``prepare`` / ``commit`` split as in the ``disk`` transport,
so async training writes and loads while the trainer trains on.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from miles.components import ComponentSettings, Requirement
from miles.errors import EngineError
from miles.torch_threads import to_thread
from miles.transport.base import PushReport, StagedTransport, wire_dtype
from miles.transport.disk import _COPIED
from miles.transport.files import atomic_directory, write_safetensors
from miles.transport.folders import VersionFolders
from miles.transport.manifest import Manifest, TensorEntry
from miles.transport.verify import tensor_checksum

if TYPE_CHECKING:
    import torch

    from miles.rollout.client import EngineClient
    from miles.training.trainer import DistContext, WeightBucket

__all__ = ["DiskDeltaTransport", "DiskDeltaTransportSettings"]

log = logging.getLogger(__name__)

ROUTE = "/update_weights_from_delta"


ZSTANDARD = Requirement("zstandard", extra="delta")
"""What the deltas are compressed with (the engines decompress them with it too)."""


class DiskDeltaTransportSettings(ComponentSettings):
    """Settings of the ``disk_delta`` transport."""

    dir: str | None = None
    """Where versions are written (default: ``<run_dir>/weights``); must be visible to every engine."""
    full_every: int = Field(20, ge=1)
    """A full snapshot for every engine every this many pushes (1: every push is full)."""
    level: int = Field(1, ge=-7, le=22)
    """zstd compression level of the deltas (higher: smaller and slower; negative: faster)."""
    threads: int = Field(0, ge=-1)
    """zstd worker threads (0: compress on the calling thread; -1: one per CPU)."""
    keep_versions: int = Field(1, ge=1)
    """How many pushed versions stay on disk while the run goes on."""
    keep_after_run: bool = False
    """Leave the last pushed versions on disk when the run ends (as the ``disk`` transport: they are scratch
    for the engines)."""
    sync: bool = True
    """Flush every file to stable storage before a version is renamed into place (needless on tmpfs)."""


class DiskDeltaTransport(VersionFolders, StagedTransport[DiskDeltaTransportSettings]):
    """Writes XOR deltas (or full snapshots) with a checksum manifest; engines apply and verify them."""

    name = "disk_delta"
    engine_routes = (ROUTE,)
    requires = (ZSTANDARD,)

    def __init__(
        self, settings: DiskDeltaTransportSettings, *, run_dir: str, model_path: str | None, engine_dtype: str
    ) -> None:
        super().__init__(settings, run_dir=run_dir, model_path=model_path, engine_dtype=engine_dtype)
        self.root = Path(settings.dir or Path(run_dir) / "weights")
        self.client: EngineClient | None = None
        self.base: dict[str, torch.Tensor] | None = None
        """The last pushed version (engine dtype), what deltas are taken against."""
        self.base_version: str | None = None
        self.delivered: dict[str, str] = {}
        """Per engine URL, the version this transport last made it serve."""
        self.pushes = 0
        self.written: list[Path] = []
        self._staged: dict[str, dict[str, torch.Tensor]] = {}
        self._folders: dict[str, dict[str, Path]] = {}
        self._written_bytes: dict[str, int] = {}
        self._full_lock = asyncio.Lock()

    # -- trainer side -------------------------------------------------------------------------------
    async def stage(
        self, buckets: Iterable[WeightBucket], *, version: str, dist: DistContext, snapshot: bool = True
    ) -> PushReport:
        """Copy the weights in the engine dtype (rank 0; they become the base of the next delta)."""
        import torch

        start = time.perf_counter()
        report = PushReport(version=version)
        dtype = getattr(torch, self.engine_dtype)
        tensors: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            if dist.rank != 0:
                continue  # the other ranks only take part in the gathers
            for name, t in bucket:
                if name in tensors:
                    raise ValueError(f"disk_delta transport: tensor {name!r} appears twice in one push")
                tensors[name] = t.detach().to(device="cpu", dtype=wire_dtype(name, t, dtype), copy=True).contiguous()
        if dist.rank == 0:
            self._staged[version] = tensors
            report.num_tensors = len(tensors)
            report.num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        report.seconds = time.perf_counter() - start
        return report

    def _delta_possible(self, tensors: dict[str, torch.Tensor]) -> bool:
        base = self.base
        if base is None or self.pushes % self.settings.full_every == 0:
            return False
        return base.keys() == tensors.keys() and all(
            base[n].shape == t.shape and base[n].dtype == t.dtype for n, t in tensors.items()
        )

    def _needs_full(self, delta: bool) -> list[str]:
        urls = list(self.client.urls) if self.client is not None else []
        if not delta:
            return urls
        return [url for url in urls if self.delivered.get(url) != self.base_version]

    def _write_delta(self, version: str, tensors: dict[str, torch.Tensor], checksums: dict[str, str]) -> Path:
        from miles.transport.delta_codec import encode_delta

        zstandard = ZSTANDARD.load("transport 'disk_delta'")

        assert self.base is not None and self.base_version is not None
        compressor = zstandard.ZstdCompressor(
            level=self.settings.level, write_checksum=True, threads=self.settings.threads
        )
        manifest = Manifest(kind="delta", version=version, base_version=self.base_version, dtype=self.engine_dtype)
        target = self.root / f"delta-v{version}"
        with atomic_directory(target, sync=self.settings.sync) as folder:
            offset = 0
            with open(folder / "delta.bin", "wb") as f:
                for name, t in tensors.items():
                    frame = encode_delta(t, self.base[name], compressor)
                    entry = TensorEntry(
                        name=name,
                        dtype=str(t.dtype).removeprefix("torch."),
                        shape=list(t.shape),
                        checksum=checksums[name],
                        encoding="same" if frame is None else "xor-zstd",
                    )
                    if frame is not None:
                        f.write(frame)
                        entry.file, entry.offset, entry.length = "delta.bin", offset, len(frame)
                        offset += len(frame)
                    manifest.tensors.append(entry)
            manifest.files["delta.bin"] = offset
            size = offset + manifest.write(folder)
        self._written_bytes[version] = self._written_bytes.get(version, 0) + size
        return target

    def _write_full(self, version: str, tensors: dict[str, torch.Tensor], checksums: dict[str, str]) -> Path:
        manifest = Manifest(kind="full", version=version, base_version=None, dtype=self.engine_dtype)
        target = self.root / f"full-v{version}"
        with atomic_directory(target, sync=self.settings.sync) as folder:
            size = write_safetensors(folder / "model.safetensors", tensors)
            manifest.files["model.safetensors"] = size
            for name, t in tensors.items():
                manifest.tensors.append(
                    TensorEntry(
                        name=name,
                        dtype=str(t.dtype).removeprefix("torch."),
                        shape=list(t.shape),
                        checksum=checksums[name],
                        encoding="safetensors",
                        file="model.safetensors",
                    )
                )
            if self.model_path is not None:
                for name in _COPIED:
                    source = Path(self.model_path) / name
                    if source.exists():
                        shutil.copy2(source, folder / name)
            size += manifest.write(folder)
        self._written_bytes[version] = self._written_bytes.get(version, 0) + size
        return target

    def _prepare(self, report: PushReport) -> None:
        tensors = self._staged[report.version]
        for name, t in tensors.items():
            report.checksums[name] = tensor_checksum(t)
        folders: dict[str, Path] = {}
        delta = self._delta_possible(tensors)
        if delta:
            folders["delta"] = self._write_delta(report.version, tensors, report.checksums)
        if self._needs_full(delta):
            folders["full"] = self._write_full(report.version, tensors, report.checksums)
        self._folders[report.version] = folders

    async def prepare(self, report: PushReport) -> None:
        """Checksums and the version's folders, in a worker thread (the engines keep generating)."""
        start = time.perf_counter()
        await to_thread(self._prepare, report)
        report.seconds += time.perf_counter() - start

    # -- engine side --------------------------------------------------------------------------------
    async def _load(self, url: str, folder: Path, version: str) -> None:
        assert self.client is not None
        await self.client.call(url, ROUTE, {"path": str(folder), "weight_version": version, "flush_cache": True})

    async def _deliver(self, url: str, report: PushReport, folders: dict[str, Path]) -> str:
        """Make one engine serve the version: the delta if it applies, else the full snapshot."""
        from miles.rollout.http_client import EngineHTTPError

        version = report.version
        if "delta" in folders and self.delivered.get(url) == self.base_version:
            try:
                await self._load(url, folders["delta"], version)
                return "delta"
            except EngineHTTPError as exc:  # the engine refused and rolled back: it still serves its version
                log.warning("disk_delta transport: %s refused the delta (%s); sending a full snapshot", url, exc)
        async with self._full_lock:  # written once, for the first engine that needs it
            if "full" not in folders:
                tensors = self._staged[version]
                folders["full"] = await to_thread(self._write_full, version, tensors, report.checksums)
        await self._load(url, folders["full"], version)
        return "full"

    async def commit(self, report: PushReport) -> None:
        """Every engine applies the delta (or loads the full snapshot) and verifies it.

        When an engine fails, the version stays staged and the engines that took it are remembered: a commit
        of it again (the publisher's, after the engine died) delivers it to the engines that lack it only."""
        if self.client is None:
            raise RuntimeError("disk_delta transport: push on rank 0 before connect() gave it the engines")
        start = time.perf_counter()
        version = report.version
        if version not in self._folders:
            await self.prepare(report)
        folders = self._folders[version]
        urls = [url for url in self.client.urls if self.delivered.get(url) != version]
        results = await asyncio.gather(*(self._deliver(url, report, folders) for url in urls), return_exceptions=True)
        failed = [(url, r) for url, r in zip(urls, results, strict=True) if isinstance(r, BaseException)]
        for url, r in zip(urls, results, strict=True):
            if not isinstance(r, BaseException):
                self.delivered[url] = version
            else:
                self.delivered.pop(url, None)  # unknown state: a full snapshot next time
        self.written.extend(folder for folder in folders.values() if folder not in self.written)
        kinds = [r for r in results if isinstance(r, str)]
        full = report.metrics.get("weight_sync/full_snapshots", 0.0) + kinds.count("full")
        report.metrics["weight_sync/full_snapshots"] = full
        report.seconds += time.perf_counter() - start
        if failed:
            url, error = failed[0]
            raise EngineError(f"disk_delta transport: engine {url} did not load version {version}: {error}")
        del self._folders[version]
        self.base, self.base_version = self._staged.pop(version), version
        self.pushes += 1
        self._prune(keep=set(folders.values()))
        written = self._written_bytes.pop(version, 0)
        report.metrics.update(
            {
                "weight_sync/bytes_written": float(written),
                "weight_sync/written_fraction": written / report.num_bytes if report.num_bytes else 0.0,
            }
        )
        log.info(
            "disk_delta transport: version %s, %d tensors, %.1f MB written (%.1f%% of the weights) in %.2fs",
            version,
            report.num_tensors,
            written / 1e6,
            100 * written / max(report.num_bytes, 1),
            report.seconds,
        )

    def _prune(self, keep: set[Path]) -> None:
        versions: list[str] = []
        for folder in self.written:
            v = folder.name.split("-v", 1)[1]
            if v not in versions:
                versions.append(v)
        old = set(versions[: -self.settings.keep_versions])
        for folder in [f for f in self.written if f.name.split("-v", 1)[1] in old and f not in keep]:
            shutil.rmtree(folder, ignore_errors=True)
            self.written.remove(folder)
