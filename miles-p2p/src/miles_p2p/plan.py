"""The route plan: which trainer rank sends which slice of which tensor to which engine, and where it lands.

Inputs are two layouts: the **trainer layout** (every rank's slices: name, full shape, offsets, shape —
from :meth:`~miles.training.trainer.Trainer.iter_weight_shards`, gathered as JSON, no tensors) and the
**engine layout** of each engine (the tensors it serves, their dtype, the part of each it holds — the
whole tensor for the local engine — and its tied aliases). The plan intersects every trainer slice with
every engine's part: each non-empty intersection is a **chunk**, placed at an aligned byte offset of that
engine's receive buffer. A slice held by several ranks (a replica) is sent by one of them, chosen to
even out the bytes each rank sends. Slices that leave part of a tensor uncovered, overlap, or name a
tensor the engines do not serve are errors that name the tensor.

The plan depends only on the layouts, so every rank computes the same plan from the same inputs; it is
recomputed when its :attr:`RoutePlan.key` changes (engines joining or leaving, a new trainer layout).
Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ALIGN",
    "EngineLayout",
    "PlanError",
    "Route",
    "RoutePlan",
    "SliceInfo",
    "engines_digest",
    "layout_key",
    "make_plan",
]

ALIGN = 64
"""Byte alignment of chunks in an engine's receive buffer."""

ELEMENT_SIZE = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
}


class PlanError(ValueError):
    """The layouts cannot be matched (names the tensor)."""


Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, shape)`` of a box inside a tensor."""


@dataclass(frozen=True)
class SliceInfo:
    """One slice a trainer rank holds (the metadata of a :class:`~miles.training.trainer.WeightShard`)."""

    rank: int
    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def to_json(self) -> list[Any]:
        return [self.name, list(self.global_shape), list(self.offsets), list(self.shape)]

    @classmethod
    def from_json(cls, rank: int, raw: list[Any]) -> SliceInfo:
        name, global_shape, offsets, shape = raw
        return cls(rank, str(name), tuple(global_shape), tuple(offsets), tuple(shape))


@dataclass(frozen=True)
class EngineLayout:
    """What one engine serves: ``{name: (dtype, shape)}``, the part of each it holds, and its aliases."""

    url: str
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    aliases: dict[str, str] = field(default_factory=dict)
    """``{alias: canonical}``: names that share another parameter's storage (tied embeddings)."""
    parts: dict[str, Box] = field(default_factory=dict)
    """The box of each tensor this engine holds, where not the whole tensor (a tensor-parallel rank)."""

    @classmethod
    def from_session(cls, url: str, answer: dict[str, Any]) -> EngineLayout:
        """From an engine's ``/p2p/open_session`` answer."""
        tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        parts: dict[str, Box] = {}
        for t in answer["tensors"]:
            tensors[str(t["name"])] = (str(t["dtype"]), tuple(int(s) for s in t["shape"]))
            if "offsets" in t:
                parts[str(t["name"])] = (tuple(t["offsets"]), tuple(t["part_shape"]))
        return cls(url, tensors, {str(k): str(v) for k, v in answer.get("aliases", {}).items()}, parts)


@dataclass(frozen=True)
class Route:
    """One chunk: ``src`` rank sends ``name[offsets : offsets + shape]`` to engine ``engine``."""

    id: int
    engine: int
    src: int
    name: str
    """The engine's name of the tensor."""
    source_name: str
    """The trainer's name of it (differs for a tied alias)."""
    offsets: tuple[int, ...]
    """Where the chunk sits in the full tensor."""
    shape: tuple[int, ...]
    slice_offsets: tuple[int, ...]
    """Where the chunk starts inside the sending rank's slice."""
    slice_at: tuple[int, ...]
    """The sending slice's offsets in the full tensor (which of the rank's slices it is)."""
    offset: int
    """Byte offset in the engine's receive buffer."""
    nbytes: int
    dtype: str

    def chunk(self) -> dict[str, Any]:
        """The chunk as ``/p2p/plan`` takes it."""
        return {
            "id": self.id,
            "name": self.name,
            "offsets": list(self.offsets),
            "shape": list(self.shape),
            "src": self.src,
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    def describe(self) -> str:
        box = ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.shape, strict=True))
        return f"{self.name!r}[{box}] from trainer rank {self.src}"

    @property
    def content(self) -> str:
        """What the chunk carries (the same for every engine it goes to): the tensor, where and its shape."""
        return f"{self.name}|{list(self.offsets)}|{list(self.shape)}"


@dataclass
class RoutePlan:
    """Routes per engine, with the layouts' key and a plan id."""

    routes: list[Route]
    buffer_bytes: list[int]
    """Receive-buffer size of each engine."""
    key: str
    tensor_bytes: int
    """Bytes of one copy of the model in the engines' dtypes."""
    tensors: int

    @property
    def plan_id(self) -> str:
        return self.key[:16]

    def for_engine(self, engine: int) -> list[Route]:
        return [r for r in self.routes if r.engine == engine]

    def for_rank(self, rank: int) -> list[Route]:
        return [r for r in self.routes if r.src == rank]


def engines_digest(engines: list[EngineLayout]) -> str:
    """A digest of the engines' layouts (computed once per session)."""
    payload = [
        [
            e.url,
            sorted((n, d, list(shape)) for n, (d, shape) in e.tensors.items()),
            sorted(e.aliases.items()),
            sorted((n, list(o), list(sh)) for n, (o, sh) in e.parts.items()),
        ]
        for e in engines
    ]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def layout_key(slices: list[SliceInfo], engines: list[EngineLayout] | str, extra: str = "") -> str:
    """A digest of both layouts (the plan is recomputed when it changes); ``engines`` may be their
    :func:`engines_digest`."""
    digest = engines if isinstance(engines, str) else engines_digest(engines)
    rows = [[s.rank, s.name, s.global_shape, s.offsets, s.shape] for s in slices]
    return hashlib.sha256(json.dumps([rows, digest, extra]).encode()).hexdigest()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _intersect(a: Box, b: Box) -> Box | None:
    offsets, shape = [], []
    for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        shape.append(hi - lo)
    return tuple(offsets), tuple(shape)


def _holders(name: str, slices: list[SliceInfo], full: tuple[int, ...]) -> list[tuple[Box, list[int]]]:
    """The distinct boxes of ``name`` and the ranks holding each; they must tile the tensor exactly."""
    boxes: dict[Box, list[int]] = {}
    for s in slices:
        if s.global_shape != full:
            raise PlanError(
                f"tensor {name!r}: trainer rank {s.rank} has shape {list(s.global_shape)}, the engines {list(full)}"
            )
        if len(s.offsets) != len(full) or any(
            o < 0 or o + n > f for o, n, f in zip(s.offsets, s.shape, full, strict=True)
        ):
            raise PlanError(
                f"tensor {name!r}: trainer rank {s.rank}'s slice at {list(s.offsets)} lies outside {list(full)}"
            )
        if _numel(s.shape):
            boxes.setdefault((s.offsets, s.shape), []).append(s.rank)
    distinct = list(boxes)
    for i, a in enumerate(distinct):
        for b in distinct[i + 1 :]:
            if _intersect(a, b) is not None:
                raise PlanError(f"tensor {name!r}: trainer slices at {list(a[0])} and {list(b[0])} overlap")
    covered = sum(_numel(b[1]) for b in distinct)
    if covered != _numel(full):
        raise PlanError(
            f"tensor {name!r}: the trainer ranks hold {covered} of its {_numel(full)} elements (a slice is missing)"
        )
    return [(b, boxes[b]) for b in distinct]


def make_plan(slices: list[SliceInfo], engines: list[EngineLayout], extra: str = "") -> RoutePlan:
    """The routes from ``slices`` to ``engines`` (see the module docstring); raises :class:`PlanError`."""
    if not engines:
        raise PlanError("no engines to plan for")
    reference = engines[0]
    by_name: dict[str, list[SliceInfo]] = {}
    for s in slices:
        by_name.setdefault(reference.aliases.get(s.name, s.name), []).append(s)
    trainer_names = {s.name for s in slices}
    for engine in engines:
        served = set(engine.tensors)
        unknown = sorted({engine.aliases.get(n, n) for n in trainer_names} - served)
        if unknown:
            raise PlanError(f"engine {engine.url} does not serve tensor {unknown[0]!r} that the trainer holds")
        missing = sorted(served - set(by_name))
        if missing:
            raise PlanError(f"engine {engine.url} serves tensor {missing[0]!r} that no trainer rank holds")
    sent_bytes: dict[int, int] = {}
    routes: list[Route] = []
    buffer_bytes = [0] * len(engines)
    tensor_bytes = 0
    # one holder per distinct box, balanced over ranks; the same for every engine
    chosen: list[tuple[str, str, Box, int, str]] = []
    for name, held in by_name.items():
        dtype, full = reference.tensors[name]
        if dtype not in ELEMENT_SIZE:
            raise PlanError(f"tensor {name!r}: unsupported dtype {dtype}")
        tensor_bytes += _numel(full) * ELEMENT_SIZE[dtype]
        sources = {s.rank: s.name for s in held}
        for box, ranks in _holders(name, held, full):
            rank = min(ranks, key=lambda r: (sent_bytes.get(r, 0), r))
            sent_bytes[rank] = sent_bytes.get(rank, 0) + _numel(box[1]) * ELEMENT_SIZE[dtype]
            chosen.append((name, sources[rank], box, rank, dtype))
    chosen.sort(key=lambda c: c[3])  # each rank's chunks lie together in every buffer
    for e, engine in enumerate(engines):
        for name, source_name, box, rank, _ in chosen:
            dtype, full = engine.tensors[name]
            part = engine.parts.get(name, ((0,) * len(full), full))
            inter = _intersect(box, part)
            if inter is None:
                continue
            offset = -(-buffer_bytes[e] // ALIGN) * ALIGN
            nbytes = _numel(inter[1]) * ELEMENT_SIZE[dtype]
            routes.append(
                Route(
                    id=len(routes),
                    engine=e,
                    src=rank,
                    name=name,
                    source_name=source_name,
                    offsets=tuple(i - p for i, p in zip(inter[0], part[0], strict=True)),
                    shape=inter[1],
                    slice_offsets=tuple(i - b for i, b in zip(inter[0], box[0], strict=True)),
                    slice_at=box[0],
                    offset=offset,
                    nbytes=nbytes,
                    dtype=dtype,
                )
            )
            buffer_bytes[e] = offset + nbytes
    return RoutePlan(
        routes=routes,
        buffer_bytes=buffer_bytes,
        key=layout_key(slices, engines, extra),
        tensor_bytes=tensor_bytes,
        tensors=len(by_name),
    )
