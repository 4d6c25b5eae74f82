"""Engine side of the ``disk_delta`` transport: ``/update_weights_from_delta {path, weight_version, flush_cache}``.

A Miles endpoint (SGLang has no counterpart: it loads full checkpoints with ``/update_weights_from_disk``,
which serves the ``full-v<N>`` folders as they are). ``path`` is a version folder with a manifest
(:mod:`miles.transport.manifest`):

- ``full``: every tensor is read from the memory-mapped safetensors file and checked against its manifest
  checksum *before* any parameter changes; then copied in.
- ``delta``: refused unless the engine serves the manifest's ``base_version``. Changed tensors are XORed
  into the parameters in place, unchanged ones are only checked; every tensor must then match its
  checksum, else every applied delta is XORed again (XOR is its own inverse) and the engine keeps serving
  the base version bit for bit.

Either way generation pauses (``retract``) for the load unless already paused, the version is set and the
prefix cache flushed, as ``/update_weights_from_disk`` does. Runs on the scheduler thread. The built-in
plugin ``local_engine`` adds the route (``miles_engine_routes``).
"""

from __future__ import annotations

import asyncio
import logging
import mmap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from fastapi import FastAPI
from fastapi import Request as HTTPRequest

from miles.engine.faults import die_in_push_if_asked
from miles.engine.responses import admin
from miles.engine.weights import served_parameters
from miles.transport.manifest import Manifest, TensorEntry
from miles.transport.verify import tensor_checksum

if TYPE_CHECKING:
    from miles.engine.state import EngineState

__all__ = ["add_delta_routes", "apply_version"]

log = logging.getLogger(__name__)


def _resolve(model: torch.nn.Module, manifest: Manifest, folder: Path) -> list[tuple[TensorEntry, torch.Tensor]]:
    params = served_parameters(model)
    pairs = []
    for entry in manifest.tensors:
        target = params.get(entry.name)
        if target is None:
            raise ValueError(f"{folder}: tensor {entry.name!r} is not a parameter of the served model")
        if list(target.shape) != list(entry.shape) or str(target.dtype).removeprefix("torch.") != entry.dtype:
            raise ValueError(
                f"{folder}: tensor {entry.name!r} is {entry.dtype} {entry.shape}, the engine serves "
                f"{str(target.dtype).removeprefix('torch.')} {list(target.shape)}"
            )
        pairs.append((entry, target))
    return pairs


def _apply_full(pairs: list[tuple[TensorEntry, torch.Tensor]], folder: Path) -> None:
    from miles.transport.files import map_safetensors

    files = {entry.file for entry, _ in pairs}
    mapped: dict[str, dict[str, torch.Tensor]] = {}
    for file in files:
        if file is None:
            raise ValueError(f"{folder}: a full version names no file for some tensor")
        mapped[file] = map_safetensors(folder / file)
    sources = []
    for entry, target in pairs:
        assert entry.file is not None
        source = mapped[entry.file].get(entry.name)
        if source is None:
            raise ValueError(f"{folder / entry.file}: has no tensor {entry.name!r}")
        if tensor_checksum(source) != entry.checksum:
            raise ValueError(f"{folder / entry.file}: tensor {entry.name!r} does not match its manifest checksum")
        sources.append((target, source))
    for i, (target, source) in enumerate(sources):
        target.copy_(source)
        die_in_push_if_asked(i + 2, unit="tensor")  # (tensor i + 1 is in)


def _apply_delta(pairs: list[tuple[TensorEntry, torch.Tensor]], folder: Path) -> None:
    import zstandard

    from miles.transport.delta_codec import decode_delta, xor_

    decompressor = zstandard.ZstdDecompressor()
    maps: dict[str, mmap.mmap] = {}
    applied: list[tuple[torch.Tensor, torch.Tensor]] = []
    done: set[int] = set()  # storages already updated (a tied pair named twice is applied once)
    try:
        for entry, target in pairs:
            if entry.encoding == "xor-zstd" and id(target) not in done:
                if entry.file is None:
                    raise ValueError(f"{folder}: changed tensor {entry.name!r} names no file")
                if entry.file not in maps:
                    with open(folder / entry.file, "rb") as f:
                        maps[entry.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                frame = memoryview(maps[entry.file])[entry.offset : entry.offset + entry.length]
                try:
                    delta = decode_delta(frame, target, decompressor)
                except ValueError as exc:
                    raise ValueError(f"{folder / entry.file}: tensor {entry.name!r}: {exc}") from None
                finally:
                    frame.release()
                xor_(target, delta)
                applied.append((target, delta))
                done.add(id(target))
                die_in_push_if_asked(len(applied) + 1, unit="tensor")
            elif entry.encoding not in ("xor-zstd", "same"):
                raise ValueError(f"{folder}: tensor {entry.name!r} has encoding {entry.encoding!r} in a delta")
        for entry, target in pairs:
            if tensor_checksum(target) != entry.checksum:
                raise ValueError(
                    f"{folder}: tensor {entry.name!r} does not match its manifest checksum after the delta "
                    "(this engine's weights are not the delta's base); rolled back"
                )
    except BaseException:
        for target, delta in reversed(applied):
            xor_(target, delta)
        raise
    finally:
        for m in maps.values():
            m.close()


@torch.no_grad()
def apply_version(model: torch.nn.Module, folder: str | Path, *, current_version: str) -> Manifest:
    """Apply the version in ``folder`` to ``model`` (see the module docstring); ``ValueError`` leaves the
    model as it was."""
    path = Path(folder)
    manifest = Manifest.read(path)
    if manifest.kind == "delta" and manifest.base_version != current_version:
        raise ValueError(
            f"{path}: a delta against version {manifest.base_version!r}; this engine serves {current_version!r}"
        )
    pairs = _resolve(model, manifest, path)
    if manifest.kind == "full":
        _apply_full(pairs, path)
    else:
        _apply_delta(pairs, path)
    return manifest


def add_delta_routes(app: FastAPI, state: EngineState) -> None:
    """Mount ``/update_weights_from_delta`` on ``app``."""
    sched = state.scheduler

    @app.post("/update_weights_from_delta")
    async def update_weights_from_delta(request: HTTPRequest) -> Any:
        async def run(body: dict[str, Any]) -> Any:
            path = body.get("path")
            if not isinstance(path, str) or not path:
                raise ValueError("path (a version folder written by the disk_delta transport) is required")
            path = state.weight_path(path, field="path")
            version = body.get("weight_version")
            flush = bool(body.get("flush_cache", True))

            def load() -> dict[str, Any]:
                was_paused = sched.paused is not None
                if not was_paused:
                    sched.pause("retract")
                try:
                    manifest = apply_version(sched.runner.model, path, current_version=sched.weight_version)
                finally:
                    if not was_paused:
                        sched.resume()
                sched.set_weight_version(manifest.version if version is None else str(version))
                if flush:
                    sched.flush_cache()
                changed = sum(e.encoding != "same" for e in manifest.tensors)
                log.info("applied %s version %s (%d tensors changed)", manifest.kind, sched.weight_version, changed)
                return {"kind": manifest.kind, "changed_tensors": changed}

            result = await asyncio.wrap_future(sched.submit(load))
            return {"success": True, "message": f"loaded {path}", "weight_version": sched.weight_version, **result}

        return await admin(request, run)
