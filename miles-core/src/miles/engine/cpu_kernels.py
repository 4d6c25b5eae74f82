"""Miles' CPU kernels (decode attention, fused RMSNorm and rotary embedding, bfloat16 linear layers of a few
rows, a decode step's whole layer in one call), compiled on first use.

At a decode step every (request, KV head) pair attends a few query rows (a head group) over its own cached
positions. PyTorch's CPU flash-attention kernel spends most of that time in per-block overhead: on the
development machine (2 cores, SmolLM2-135M, batch 32, 33-96 positions) it took 180-300 us per layer where
this kernel takes 60-130 us (bfloat16) and 40-120 us (float32), about a sixth of a bfloat16 decode step.
The kernel (``csrc/decode_attention.cpp``) does, per pair and in a fixed order (so batch-invariant):
write the step's key and value at the request's position (the KV write the engine otherwise does with an
indexed copy), fp32 scores ``q . k`` over positions ``0..pos`` (``-inf`` beyond), then ``torch.softmax``,
then the fp32-accumulated ``probs . V`` in the cache's dtype.

The residual add + RMSNorm and the rotary embedding of a decoder layer are eight and five small PyTorch ops
(each a few microseconds of dispatch and a pass over memory at decode sizes); ``csrc/elementwise.cpp`` does
each in one pass with the rounding of the HF modules (bit for bit in bfloat16; the float32 norm sums its
squares in another order). Together they took a SmolLM2 bfloat16 decode step at batch 32 from 32-35 ms to
26-28 ms on the development machine.

At batch 1 a bfloat16 decode step reads every weight for one row of arithmetic: it is bound by memory, and
oneDNN's prepacked GEMM read SmolLM2's weights at 12-16 GB/s on the development machine (a Xeon with AMX, 21-27 GB/s
of read bandwidth). ``csrc/linear_rows.cpp`` streams each weight row once through AVX-512 BF16 dot products
(float32 sums, rounded to bfloat16 once), prefetching the rows it reads next, at 18-21 GB/s: SmolLM2's bfloat16
decode at batch 1 went from 33-43 to 50-55 tok/s. It is built where the CPU has AVX-512 BF16
(``linear_rows_available()``); the engine calls it for bfloat16 linears of one row, and of up to 8 where it
measured it as fast as oneDNN on the model's own weights (:func:`measure_rows`, once, at the first forward of a
few rows: on an AMD EPYC without AMX it read 24 GB/s at 2 rows against oneDNN's 13, decode at 2 / 4 / 8 requests
1.35x / 1.23x / 1.12x; on the Xeon with AMX, before the prefetch, oneDNN was as fast from two rows). At one and
two rows it reads the weight rows one after the other (one stream through memory: 25-31 GB/s on the AMD EPYC
where 16 rows read side by side gave 22-24), with the same sums in the same order.

There a decode step spent 3-5 ms of its 14-17 ms in Python (some 40 tensor operations per layer, views and kernel
calls, each a few microseconds of interpreter and dispatcher). ``csrc/decode_block.cpp`` runs a plain layer
(RMSNorms, fused q/k/v and gate/up on the row kernel, rotary, the decode attention, SiLU) in one call from Python,
the same kernels and ATen operations in the same order, so the same bits: SmolLM2's bfloat16 step at one row went
from 15.6 to 13.9 ms on the AMD EPYC; the engine uses it wherever every layer is plain
(``ModelRunner._blocks``) and no row of the step has a LoRA adapter, every layer of the step in one call
(``decode_blocks``, over the layers' weights gathered once: on an Intel Xeon without AMX 12.6 -> 11.9 ms at one
row from the gathering, and another 0.3-0.7 ms from the one call, interleaved A/Bs with the same logits).

They are built with ``torch.utils.cpp_extension`` (a C++ compiler and ``ninja``) for this CPU
(``-O3 -march=native``, OpenMP through torch's runtime) on first use (45 s on 2 idle cores, 75-98 s sharing them
with one other job; the build says how far it is every 10 s and records its time), and cached in
``$MILES_KERNEL_CACHE`` (default ``~/.cache/miles/kernels``) by :mod:`miles.engine.kernel_cache`: built at
most once per machine and source version (every virtual environment with the same torch reuses the build),
safe against a build killed half-way, with a bounded, logged wait for another process's build. The
directory's name carries a hash of the sources, the torch version, Python's ABI and the CPU's
instruction-set flags, so a cache shared by machines never loads a build made for another CPU. Where they
cannot be built, :func:`load` says why and the engine runs PyTorch ops (``attention_backend = "auto"``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MAX_GROUP",
    "MAX_HEAD_DIM",
    "ROWS_KEEP_BYTES",
    "ROWS_MEASURED",
    "KernelUnavailable",
    "decode_attention",
    "load",
    "measure_rows",
    "resolve_attention_backend",
    "rows_limit",
    "rows_limit_file",
    "save_rows_limit",
    "saved_rows_limit",
]

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in ("bindings.cpp", "decode_attention.cpp", "decode_block.cpp", "elementwise.cpp", "linear_rows.cpp")
]
MAX_GROUP = 16
"""Most query heads per KV head (``kMaxGroup`` in the source)."""
MAX_HEAD_DIM = 256
"""Largest head dim (``kMaxDim``); 64 and 128 have unrolled, vectorised instances."""
ROWS_MEASURED = (2, 4, 8)
"""The row counts beyond one at which :func:`measure_rows` times the row kernel against oneDNN."""
ROWS_SWEEP_BYTES = 512 << 20
"""At most this many bytes of weights per timed sweep: more than a CPU's caches, as decode streams them."""
ROWS_KEEP_BYTES = 64 << 20
"""A limit measured over fewer bytes of weights (a tiny model, read from a cache) is used, not kept."""
ROWS_CREDIT = 0.1
"""How much slower than oneDNN's the row kernel's sweep may be and still be taken: at a few rows the kernel's path
also runs each plain decoder layer in one call (``decode_block``), which the sweep does not time: it saved 1.7 ms
of SmolLM2's 15.6 ms bfloat16 decode step at one row on an AMD EPYC (11%), where the sweeps at 8 rows came out
14.2 ms against oneDNN's 14.1 (a tie that noise decides)."""


class KernelUnavailable(RuntimeError):
    """The CPU kernel could not be built or loaded here (the message says why)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def load() -> Any:
    """The compiled module (built on first use, once per machine); raises :class:`KernelUnavailable` with
    the reason."""
    if platform.system() != "Linux":
        raise KernelUnavailable(f"the CPU kernel is built for Linux only (this is {platform.system()})")
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
    except (ImportError, RuntimeError) as exc:
        raise KernelUnavailable(f"cannot build C++ extensions: {exc} (pip install ninja)") from exc
    from miles.engine.kernel_cache import KernelBuildError, load_extension

    try:
        return load_extension(
            "miles_cpu_kernels",
            SOURCES,
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            key_extra=[_cpu_flags(), (CSRC / "common.h").read_text()],
        )
    except KernelBuildError as exc:  # a compiler error, a missing header, a build that never ends
        raise KernelUnavailable(str(exc)) from exc


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    pos: torch.Tensor,
    span: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one decode step; writes ``k_new`` / ``v_new`` into the caches first.

    :param q: ``[B, heads, head_dim]`` queries of the step.
    :param k_cache: ``[slots >= B, kv_heads, capacity, head_dim]`` one layer's keys; request ``b`` owns slot ``b``.
    :param v_cache: the same for values.
    :param k_new: ``[B, kv_heads, head_dim]`` the step's keys, written at ``pos[b]``; ``v_new`` likewise.
    :param pos: int64 ``[B]``: request ``b`` attends positions ``0..pos[b]``.
    :param span: ``max(pos) + 1`` or more (the scores' width).
    :returns: ``[B, heads, head_dim]`` in the caches' dtype.
    """
    kernel = load()
    scores = kernel.decode_scores(q, k_cache, v_cache, k_new, v_new, pos, span, scale)
    return kernel.decode_values(torch.softmax(scores, dim=-1), v_cache, pos)


def resolve_attention_backend(wanted: str, device: torch.device, group: int, head_dim: int) -> str:
    """``sdpa`` or ``miles_cpu`` for a model's decode steps (``group`` query heads per KV head): ``auto`` takes
    the kernel on CPU where it builds and supports the model, SDPA otherwise (with a warning saying why);
    ``miles_cpu`` where it cannot run raises ``ValueError`` with the reason."""
    if wanted == "sdpa":
        return "sdpa"
    reason = None
    if device.type != "cpu":
        reason = f"it runs on CPU only (the engine runs on {device})"
    elif group > MAX_GROUP or head_dim > MAX_HEAD_DIM:
        reason = f"{group} query heads per KV head / head_dim {head_dim} are beyond what it supports"
    else:
        try:
            load()
        except KernelUnavailable as exc:
            reason = str(exc)
    if reason is None:
        return "miles_cpu"
    if wanted == "miles_cpu":
        raise ValueError(f"attention_backend 'miles_cpu': {reason}")
    if device.type == "cpu":
        log.warning("running PyTorch ops (SDPA) instead of Miles' CPU kernels: %s", reason)
    return "sdpa"


def measure_rows(
    weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    *,
    budget_bytes: int = ROWS_SWEEP_BYTES,
    repeats: int = 2,
) -> tuple[dict[int, tuple[float, float]], int]:
    """Seconds of one sweep over ``weights`` (dense bfloat16, its oneDNN-packed copy, bias) with ``m`` input
    rows, for each ``m`` of :data:`ROWS_MEASURED`: ``{m: (row kernel, oneDNN)}``, the best of ``repeats``
    sweeps each, taken in turn; and the bytes of weights a sweep read. A sweep takes the weights in order up
    to ``budget_bytes`` (streamed from memory, as a decode step reads them, where they outsize the caches)."""
    kernel = load()
    picked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    total = 0
    for entry in weights:
        picked.append(entry)
        total += entry[0].numel() * entry[0].element_size()
        if total >= budget_bytes:
            break
    g = torch.Generator().manual_seed(0)
    times: dict[int, tuple[float, float]] = {}
    with torch.inference_mode():
        for m in ROWS_MEASURED:
            xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {w.shape[1] for w, _, _ in picked}}
            best = [float("inf"), float("inf")]
            for onednn in (False, True):
                _sweep(kernel, picked, xs, onednn=onednn)  # warm
            for _ in range(repeats):
                for i, onednn in enumerate((False, True)):
                    best[i] = min(best[i], _sweep(kernel, picked, xs, onednn=onednn))
            times[m] = (best[0], best[1])
    return times, total


def _sweep(
    kernel: Any,
    weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    xs: Mapping[int, torch.Tensor],
    *,
    onednn: bool,
) -> float:
    """Seconds of one pass over ``weights`` on the row kernel or on oneDNN's packed GEMM."""
    start = time.perf_counter()
    for w, packed, b in weights:
        if onednn:
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], packed, b, "none", [], "")
        else:
            kernel.linear_rows(xs[w.shape[1]], w, b)
    return time.perf_counter() - start


def rows_limit(times: Mapping[int, tuple[float, float]], credit: float = ROWS_CREDIT) -> int:
    """The most input rows up to which the row kernel's sweep took at most ``1 + credit`` times oneDNN's at every
    row count of ``times`` (:func:`measure_rows`; :data:`ROWS_CREDIT`), counting up; 1 (the kernel's measured
    home, a decode step at batch 1) where it lost at the fewest."""
    limit = 1
    for m in sorted(times):
        rows, onednn = times[m]
        if rows > onednn * (1 + credit):
            break
        limit = m
    return limit


def rows_limit_file() -> Path:
    """Where this machine's :func:`rows_limit` is kept: beside the kernels' build (one per CPU, source version
    and torch), so that every engine here decodes the same way (the kernel and oneDNN round differently) and
    measures once. Deleting it measures again."""
    return Path(load().__file__).parent / "rows_limit.json"


def saved_rows_limit() -> int | None:
    """The limit measured on this machine before, if any (an unreadable file counts as none)."""
    try:
        limit = json.loads(rows_limit_file().read_text())["rows_limit"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return limit if limit in (1, *ROWS_MEASURED) else None


def save_rows_limit(limit: int, times: Mapping[int, tuple[float, float]]) -> Path:
    """Keep ``limit`` (and the sweep times it came from) in :func:`rows_limit_file`, written whole."""
    path = rows_limit_file()
    record = {
        "rows_limit": limit,
        "seconds": {str(m): {"kernel": k, "onednn": d} for m, (k, d) in times.items()},
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    partial.replace(path)
    return path
