"""What SGLang's CPU path needs from this host: the instruction sets its CPU kernels are compiled for, and
the kernel package itself.

Standard library only (``scripts/sglang/cpu_env.py`` loads this file before any environment exists): the
kernels of ``third_party/sgl-kernel-cpu`` are compiled with ``-march=x86-64-v4 -mavx512bf16 -mavx512vnni``
and die with SIGILL on a CPU without those instructions, so a host without them is refused (or its tests
skipped) with the missing flags named. AMX is optional: with it SGLang uses its ``intel_amx`` attention and
packed linear layers, without it its ``torch_native`` attention.
"""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

__all__ = [
    "BUILD_HINT",
    "KERNEL_PACKAGE",
    "OPTIONAL_CPU_FLAGS",
    "REQUIRED_CPU_FLAGS",
    "cpu_flags",
    "cpu_model",
    "kernels_installed",
    "missing_cpu_flags",
]

REQUIRED_CPU_FLAGS = (
    "avx512f",
    "avx512bw",
    "avx512cd",
    "avx512dq",
    "avx512vl",
    "avx512_bf16",
    "avx512_vnni",
)
"""``/proc/cpuinfo`` flags the CPU kernels are compiled for (x86-64-v4 plus AVX-512 BF16 and VNNI)."""

OPTIONAL_CPU_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")
"""Used when present (through torch's brgemm); SGLang falls back to its ``torch_native`` attention without."""

KERNEL_PACKAGE = "sgl_kernel"
"""The import name of the CPU kernel package (distribution ``sglang-kernel-cpu``)."""

BUILD_HINT = (
    "build the SGLang CPU environment from a Miles checkout with `python scripts/sglang/cpu_env.py` "
    "and run Miles with the python it prints (docs/how-to/sglang-cpu.md)"
)
"""How to get an environment in which SGLang serves on this CPU."""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU feature flags of this host (the ``flags`` line of ``/proc/cpuinfo``; empty elsewhere)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's ``model name`` (``/proc/cpuinfo``), or what :mod:`platform` says."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine()


def missing_cpu_flags(flags: set[str] | None = None) -> list[str]:
    """Required flags this CPU lacks, in :data:`REQUIRED_CPU_FLAGS` order (all of them off x86-64)."""
    if flags is None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return list(REQUIRED_CPU_FLAGS)
        flags = cpu_flags()
    return [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]


def kernels_installed() -> bool:
    """Whether the CPU kernel package can be imported here (looked up, not imported)."""
    return importlib.util.find_spec(KERNEL_PACKAGE) is not None
