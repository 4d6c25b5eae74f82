"""The ``shm`` transport: trainer rank 0 writes each bucket as a safetensors file in shared memory, cast
straight into place; the engines on the same host load the folder with ``/update_weights_from_disk``.

The files live in ``/dev/shm`` (memory, not a disk), and no serialised copy of a bucket is ever built:
each file is created at its final size, memory-mapped, and every tensor is cast into its place in one
pass (the header is written first, as safetensors lays it out). Any engine that speaks SGLang's
``/update_weights_from_disk`` on the same host can load them (the model's config and tokenizer files are
copied next to the weights). The trainer's checksums are computed while the engines load.

Uses only Miles' public interfaces: :class:`~miles.transport.base.WeightTransport`, the engine client and
:func:`~miles.transport.verify.tensor_checksum`.
"""

# --8<-- [start:imports]
from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import shutil
import struct
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from miles.components import ComponentSettings
from miles.transport.base import PushReport, WeightTransport
from miles.transport.verify import tensor_checksum

if TYPE_CHECKING:
    import torch

    from miles.rollout.client import EngineClient
    from miles.training.trainer import DistContext, WeightBucket

__all__ = ["ShmTransport", "ShmTransportSettings", "write_bucket"]
# --8<-- [end:imports]

log = logging.getLogger(__name__)

_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64", "int32": "I32"}
_COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


# --8<-- [start:settings]
class ShmTransportSettings(ComponentSettings):
    """Settings of the ``shm`` transport."""

    dir: str = "/dev/shm"
    """Shared-memory folder the versions are written under (every engine must run on this host)."""
    keep_versions: int = Field(1, ge=1)
    """How many pushed versions stay in memory."""


# --8<-- [end:settings]


def write_bucket(path: Path, bucket: WeightBucket, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Write ``bucket`` cast to ``dtype`` as a safetensors file at ``path``; returns the written tensors
    (views of the file's memory, for the checksums)."""
    import torch

    code = _CODES[str(dtype).removeprefix("torch.")]
    element = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in bucket:
        nbytes = t.numel() * element
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    size = 8 + len(raw) + offset
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    mapped[:8] = struct.pack("<Q", len(raw))
    mapped[8 : 8 + len(raw)] = raw
    data = torch.frombuffer(mapped, dtype=torch.uint8)
    written: dict[str, torch.Tensor] = {}
    at = 8 + len(raw)
    for name, t in bucket:
        nbytes = t.numel() * element
        view = data[at : at + nbytes].view(dtype).view(t.shape)
        view.copy_(t.detach())  # cast and copy in one pass, straight into the file
        written[name] = view
        at += nbytes
    return written


# --8<-- [start:transport]
class ShmTransport(WeightTransport[ShmTransportSettings]):
    """Safetensors in ``/dev/shm`` written without copies; engines load them from memory."""

    name = "shm"

    def __init__(
        self, settings: ShmTransportSettings, *, run_dir: str, model_path: str | None, engine_dtype: str
    ) -> None:
        super().__init__(settings, run_dir=run_dir, model_path=model_path, engine_dtype=engine_dtype)
        self.root = Path(settings.dir) / f"miles-shm-{uuid.uuid4().hex[:12]}"
        self.client: EngineClient | None = None
        self.versions: list[Path] = []

    async def connect(self, client: EngineClient | None, dist: DistContext) -> None:
        self.client = client
        if dist.rank == 0:
            if client is None:
                raise RuntimeError("shm transport: rank 0 needs the engine client")
            self.root.mkdir(parents=True, exist_ok=False)

    async def push(self, buckets: Iterable[WeightBucket], *, version: str, dist: DistContext) -> PushReport:
        import torch

        start = time.perf_counter()
        report = PushReport(version=version)
        dtype = getattr(torch, self.engine_dtype)
        target = self.root / f"v{version}"
        written: dict[str, torch.Tensor] = {}
        for index, bucket in enumerate(buckets):
            if dist.rank != 0 or not bucket:
                continue  # the other ranks only take part in the gathers
            target.mkdir(exist_ok=True)
            written.update(write_bucket(target / f"model-{index:05d}.safetensors", bucket, dtype))
        if dist.rank != 0:
            return report
        assert self.client is not None
        if self.model_path is not None:
            for name in _COPIED:
                source = Path(self.model_path) / name
                if source.exists():
                    shutil.copy2(source, target / name)
        report.num_tensors = len(written)
        report.num_bytes = sum(t.numel() * t.element_size() for t in written.values())

        def checksums() -> None:
            for name, t in written.items():
                report.checksums[name] = tensor_checksum(t)

        await asyncio.gather(self.client.update_weights_from_disk(str(target), version), asyncio.to_thread(checksums))
        self.versions.append(target)
        while len(self.versions) > self.settings.keep_versions:
            shutil.rmtree(self.versions.pop(0), ignore_errors=True)
        report.seconds = time.perf_counter() - start
        log.info("shm transport: version %s, %.1f MB in %.3fs", version, report.num_bytes / 1e6, report.seconds)
        return report

    async def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.versions = []


# --8<-- [end:transport]
