"""Weight files without extra copies, and directories that appear whole or not at all.

- :func:`write_safetensors` writes a standard safetensors file straight from the tensors' memory (the
  header, then each tensor's bytes): no serialised copy of the whole file is built in memory first, as
  ``safetensors.torch.save_file`` does.
- :func:`map_safetensors` opens one as tensors that view a memory map of the file (copy-on-write), so a
  reader copies each tensor once, from the page cache into its destination.
- :func:`atomic_directory` writes into ``<name>.partial`` and renames it to ``<name>`` once every file is
  flushed to disk: a crash mid-write leaves a ``.partial`` folder, never a half version under the final name.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_CODES", "atomic_directory", "fsync_tree", "map_safetensors", "write_safetensors"]

DTYPE_CODES: dict[str, str] = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}
"""torch dtype name -> safetensors dtype code."""

_ALIGN = 8


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def write_safetensors(
    path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> int:
    """Write ``tensors`` (contiguous, on the CPU) as a safetensors file; returns the bytes written."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"write_safetensors: tensor {name!r} must be contiguous and on the CPU")
        code = DTYPE_CODES.get(str(t.dtype).removeprefix("torch."))
        if code is None:
            raise ValueError(f"write_safetensors: tensor {name!r} has unsupported dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            f.write(_bytes_of(t))
    return 8 + len(raw) + offset


def map_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of a private memory map (in file order).

    Writing to them never changes the file. Raises ``ValueError`` naming the file when the header is
    malformed or a tensor's bytes lie outside the file.
    """
    import torch

    codes = {code: name for name, code in DTYPE_CODES.items()}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes)")
        (length,) = struct.unpack("<Q", f.read(8))
        if 8 + length > size:
            raise ValueError(f"{path}: header of {length} bytes runs past the end of the file")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: malformed safetensors header: {exc}") from None
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + length else None
    out: dict[str, torch.Tensor] = {}
    base = 8 + length
    entries = sorted(
        ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]
    )
    for name, entry in entries:
        dtype_name = codes.get(entry.get("dtype", ""))
        if dtype_name is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
        dtype = getattr(torch, dtype_name)
        begin, end = (int(x) for x in entry["data_offsets"])
        shape = [int(s) for s in entry["shape"]]
        if base + end > size or end < begin:
            raise ValueError(f"{path}: tensor {name!r} lies outside the file")
        if end == begin:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        assert mapped is not None
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=base + begin)
        out[name] = flat.view(dtype).view(shape)
    return out


def fsync_tree(folder: Path) -> None:
    """Flush every file of ``folder`` (and the folder itself) to stable storage."""
    for item in folder.rglob("*"):
        if item.is_file():
            fd = os.open(item, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(final: Path, *, sync: bool = True) -> Iterator[Path]:
    """Yield ``<final>.partial`` to write into; on success it is flushed and renamed to ``final``.

    An exception removes the partial folder. ``final`` must not exist (versions are never overwritten).
    """
    final = Path(final)
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    partial = final.with_name(final.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)  # left by a crashed writer
    partial.mkdir(parents=True)
    try:
        yield partial
        if sync:
            fsync_tree(partial)
        os.rename(partial, final)
        if sync:
            fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
