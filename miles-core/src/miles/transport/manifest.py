"""The manifest of a version written by the ``disk_delta`` transport (``manifest.json`` in its folder).

::

    {"format": "miles-weights/1", "kind": "delta" | "full", "version": "7", "base_version": "6" | null,
     "dtype": "bfloat16",
     "tensors": [{"name": ..., "dtype": ..., "shape": [...], "checksum": ..., "encoding": "xor-zstd" | "same"
                  | "safetensors", "file": "delta.bin" | "model.safetensors" | null, "offset": 0, "length": 0}],
     "files": {"delta.bin": 123456}}

``checksum`` is :func:`~miles.transport.verify.tensor_checksum` of the tensor *after* the version is
applied, so an engine verifies what it will serve before it serves it. ``encoding``: ``xor-zstd`` is a
frame of :mod:`miles.transport.delta_codec` at ``offset`` / ``length`` in ``file``; ``same`` means the
tensor did not change since ``base_version``; ``safetensors`` is the tensor of that name in ``file``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["FORMAT", "Manifest", "TensorEntry"]

FORMAT = "miles-weights/1"
Encoding = Literal["xor-zstd", "same", "safetensors"]


@dataclass
class TensorEntry:
    """One tensor of a version."""

    name: str
    dtype: str
    shape: list[int]
    checksum: str
    encoding: Encoding
    file: str | None = None
    offset: int = 0
    length: int = 0


@dataclass
class Manifest:
    """What a version folder holds (see the module docstring)."""

    kind: Literal["delta", "full"]
    version: str
    base_version: str | None
    dtype: str
    tensors: list[TensorEntry] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)
    """Bytes of each data file (a truncated file is refused before anything is applied)."""

    def write(self, folder: Path) -> int:
        """Write ``manifest.json`` into ``folder``; returns its size in bytes."""
        raw = json.dumps({"format": FORMAT, **asdict(self)}, indent=None, separators=(",", ":")).encode()
        (folder / "manifest.json").write_bytes(raw)
        return len(raw)

    @classmethod
    def read(cls, folder: str | Path) -> Manifest:
        """Read and check ``<folder>/manifest.json``; ``ValueError`` names the file and the problem."""
        path = Path(folder) / "manifest.json"
        if not path.is_file():
            raise ValueError(f"{path}: no manifest (not a version written by the disk_delta transport)")
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: malformed manifest: {exc}") from None
        if raw.get("format") != FORMAT:
            raise ValueError(f"{path}: format {raw.get('format')!r}, expected {FORMAT!r}")
        if raw.get("kind") not in ("delta", "full"):
            raise ValueError(f"{path}: kind {raw.get('kind')!r}, expected 'delta' or 'full'")
        try:
            tensors = [TensorEntry(**entry) for entry in raw["tensors"]]
            manifest = cls(
                kind=raw["kind"],
                version=str(raw["version"]),
                base_version=None if raw.get("base_version") is None else str(raw["base_version"]),
                dtype=str(raw["dtype"]),
                tensors=tensors,
                files={str(k): int(v) for k, v in raw.get("files", {}).items()},
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: malformed manifest entry: {exc}") from None
        for name, size in manifest.files.items():
            data = Path(folder) / name
            actual = data.stat().st_size if data.is_file() else -1
            if actual != size:
                raise ValueError(f"{data}: {actual} bytes on disk, the manifest says {size} (incomplete version)")
        return manifest
