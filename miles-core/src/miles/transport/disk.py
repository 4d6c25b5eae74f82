"""The ``disk`` transport: trainer rank 0 writes a safetensors checkpoint, engines reload it.

The simplest transport and the most portable (any engine that has ``/update_weights_from_disk``, any
filesystem both sides see). Buckets are written as shards with an index, the model's config and tokenizer
files are copied next to them, and the previous version's directory is removed once the engines serve the
new one. A push can be split (``stages``): :meth:`DiskTransport.stage` only snapshots the weights in host
memory, and :meth:`DiskTransport.commit` writes them (in a worker thread) and has the engines load them —
async training runs the commit while the trainer trains its next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from miles.components import ComponentSettings
from miles.torch_threads import to_thread
from miles.transport.base import PushReport, StagedTransport, wire_dtype
from miles.transport.folders import VersionFolders
from miles.transport.verify import tensor_checksum

if TYPE_CHECKING:
    import torch

    from miles.rollout.client import EngineClient
    from miles.training.trainer import DistContext, WeightBucket

__all__ = ["DiskTransport", "DiskTransportSettings"]

log = logging.getLogger(__name__)

_COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class DiskTransportSettings(ComponentSettings):
    """Settings of the ``disk`` transport."""

    dir: str | None = None
    """Where versions are written (default: ``<run_dir>/weights``); must be visible to every engine."""
    keep_versions: int = 1
    """How many pushed versions stay on disk while the run goes on."""
    keep_after_run: bool = False
    """Leave the last pushed versions on disk when the run ends (they are scratch for the engines: the
    run's results are its checkpoints and its HF export)."""


class DiskTransport(VersionFolders, StagedTransport[DiskTransportSettings]):
    """Trainer writes safetensors shards; engines load them with ``/update_weights_from_disk``."""

    name = "disk"

    @classmethod
    def shared_dirs(cls, options: DiskTransportSettings, *, run_dir: str) -> dict[str, str]:
        """``transport.dir`` (default ``<run_dir>/weights``): every engine loads what rank 0 writes there."""
        return {"transport.dir": str(options.dir or Path(run_dir) / "weights")}

    def __init__(
        self, settings: DiskTransportSettings, *, run_dir: str, model_path: str | None, engine_dtype: str
    ) -> None:
        super().__init__(settings, run_dir=run_dir, model_path=model_path, engine_dtype=engine_dtype)
        self.root = Path(settings.dir or Path(run_dir) / "weights")
        self.keep = max(settings.keep_versions, 1)
        self.client: EngineClient | None = None
        self.written: list[Path] = []
        self._staged: dict[str, list[dict[str, torch.Tensor]]] = {}
        self._ready: dict[str, Path] = {}

    async def stage(
        self, buckets: Iterable[WeightBucket], *, version: str, dist: DistContext, snapshot: bool = True
    ) -> PushReport:
        """Hold the weights in host memory (rank 0; the other ranks take part in the gathers), copied when
        ``snapshot``; :meth:`prepare` writes them, :meth:`commit` has the engines load them."""
        import torch

        start = time.perf_counter()
        report = PushReport(version=version)
        dtype = getattr(torch, self.engine_dtype)
        shards: list[dict[str, torch.Tensor]] = []
        for bucket in buckets:
            if dist.rank != 0 or not bucket:
                continue  # other ranks only take part in the gathers
            tensors = {
                name: t.detach().to(device="cpu", dtype=wire_dtype(name, t, dtype), copy=snapshot).contiguous()
                for name, t in bucket
            }
            shards.append(tensors)
            report.num_tensors += len(tensors)
            report.num_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if dist.rank == 0:
            self._staged[version] = shards
        report.seconds = time.perf_counter() - start
        return report

    def _write(self, report: PushReport) -> Path:
        """Write the staged shards, their index and the model's files."""
        from safetensors.torch import save_file

        shards = self._staged[report.version]
        target = self.root / f"v{report.version}"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        weight_map: dict[str, str] = {}
        for index, tensors in enumerate(shards):
            shard = f"model-{index:05d}.safetensors"
            save_file(tensors, str(target / shard), metadata={"format": "pt"})
            for name in tensors:
                weight_map[name] = shard
        total = {"metadata": {"total_size": report.num_bytes}, "weight_map": weight_map}
        (target / "model.safetensors.index.json").write_text(json.dumps(total, indent=1))
        if self.model_path is not None:
            for name in _COPIED:
                source = Path(self.model_path) / name
                if source.exists():
                    shutil.copy2(source, target / name)
        return target

    async def prepare(self, report: PushReport) -> None:
        """Write the staged version, in a worker thread (the engines keep generating meanwhile)."""
        start = time.perf_counter()
        self._ready[report.version] = await to_thread(self._write, report)
        report.seconds += time.perf_counter() - start

    async def commit(self, report: PushReport) -> None:
        """Make the engines load the written version (``/update_weights_from_disk``); remove old versions."""
        if self.client is None:
            raise RuntimeError("disk transport: push on rank 0 before connect() gave it the engines")
        start = time.perf_counter()
        if report.version not in self._ready:
            await self.prepare(report)
        target = self._ready[report.version]
        shards = self._staged[report.version]

        def checksums() -> None:
            for tensors in shards:
                for name, t in tensors.items():
                    report.checksums[name] = tensor_checksum(t)

        # the trainer's checksums are computed while the engines load (both are needed only to verify)
        await asyncio.gather(self.client.update_weights_from_disk(str(target), report.version), to_thread(checksums))
        del self._ready[report.version], self._staged[report.version]  # (kept until then: a commit may go again)
        self.written.append(target)
        while len(self.written) > self.keep:
            old = self.written.pop(0)
            shutil.rmtree(old, ignore_errors=True)
        report.seconds += time.perf_counter() - start
        log.info(
            "disk transport: version %s, %d tensors, %.1f MB in %.2fs",
            report.version,
            report.num_tensors,
            report.num_bytes / 1e6,
            report.seconds,
        )
