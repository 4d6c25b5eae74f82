"""Defaults chosen from the machine: ``precision = "auto"``, ``transport = "auto"`` and the torch threads of
the engines and trainer ranks, each with the reason it was chosen.

The choices are plain functions of the facts they depend on (:class:`MachineFacts`, :class:`TransportFacts`,
the settings), so each can be checked for any machine; the composition root (:func:`miles.compose.build_run`)
gathers the facts of this host and the installed plugins, and replaces ``auto`` with a concrete name before
any component is resolved. ``miles train`` (and ``--dry-run``) prints every choice with its reason.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "AUTO",
    "BF16_CPU_FLAGS",
    "BF16_TRAIN_SPEEDUP",
    "SPIN_COUNT",
    "Choice",
    "MachineFacts",
    "ThreadSplit",
    "TransportCandidate",
    "TransportFacts",
    "choose_engine_dtype",
    "choose_precision",
    "measure_bf16_gemm_speedup",
    "split_threads",
    "transport_candidates",
]

log = logging.getLogger(__name__)

AUTO = "auto"
"""The component name that asks Miles to choose (``precision = "auto"``, ``transport = "auto"``)."""

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""``/proc/cpuinfo`` flags of CPUs with bfloat16 units (AVX-512 BF16 dot products, AMX tiles); elsewhere
bfloat16 matmuls are emulated and slower than float32. Having the units is not enough for training: an Intel
Xeon with AMX ran oneDNN's bfloat16 GEMMs 2.4x faster than float32's and an AMD EPYC (AVX-512 BF16, no AMX)
faster too, but a Xeon whose AMX is not exposed (AVX-512 BF16 alone: one bf16 dot product a cycle where float32
has two FMA ports) runs them at 0.55x float32's (``docs/benchmarks.md``). :func:`measure_bf16_gemm_speedup`
tells which."""

BF16_TRAIN_SPEEDUP = 1.25
"""How much faster than float32's this host's bfloat16 GEMMs must run (:func:`measure_bf16_gemm_speedup`) for
``precision = "auto"`` to train in bfloat16 on a CPU: below it the trainer computes in float32 (bfloat16 adds
the weights' casts and loses mantissa for no speed) and the engines still serve bfloat16
(:func:`choose_engine_dtype`). The hosts measured so far sit far from it on both sides (2.4x with AMX, 0.55x
without)."""


@dataclass(frozen=True)
class Choice:
    """One setting Miles chose (or was told): its field, the value and why."""

    field: str
    value: str
    reason: str

    def line(self) -> str:
        return f"{self.field} = {self.value}: {self.reason}"


@dataclass(frozen=True)
class MachineFacts:
    """What the choices need to know about the host: its CPU's flags and model, and its usable cores."""

    cpu_flags: frozenset[str] = frozenset()
    cpu_model: str = ""
    cores: int = 1
    bf16_gemm_speedup: float | None = None
    """This host's bfloat16 GEMM rate over float32's (:func:`measure_bf16_gemm_speedup`); ``None``: not
    measured, the flags alone decide."""

    @classmethod
    def of_this_host(cls, cpuinfo: str | Path = "/proc/cpuinfo", *, measure_gemms: bool = False) -> MachineFacts:
        """This host's facts: the first processor's ``flags`` and ``model name`` in ``cpuinfo`` (none where the
        file is missing: no bf16 units assumed) and the cores this process may run on; with ``measure_gemms``,
        on a CPU with bfloat16 units, also how much faster its bfloat16 GEMMs run than float32's (~0.05 s)."""
        flags: frozenset[str] = frozenset()
        model = ""
        try:
            text = Path(cpuinfo).read_text(errors="replace")
        except OSError:
            text = ""
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "flags" and not flags:
                flags = frozenset(value.split())
            elif key == "model name" and not model:
                model = value.strip()
            if flags and model:
                break
        speedup = measure_bf16_gemm_speedup() if measure_gemms and flags & set(BF16_CPU_FLAGS) else None
        return cls(cpu_flags=flags, cpu_model=model, cores=usable_cores(), bf16_gemm_speedup=speedup)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# -------------------------------------------------------------------------------------------- precision
def measure_bf16_gemm_speedup(*, rounds: int = 5, shape: tuple[int, int, int] = (256, 1024, 1024)) -> float | None:
    """This host's bfloat16 GEMM rate over float32's: the trainer's GEMM (oneDNN's linear, as
    ``onednn_linear`` runs it; ``F.linear`` where torch has no oneDNN) on ``shape`` (rows, in, out: a
    micro-batch's tokens through a 1024-wide layer), the fastest of ``rounds`` timings of each dtype, taken in
    turn so that both see the same load. ``None`` where torch is missing or a GEMM fails (logged with the
    error): the flags decide, as before the measurement."""
    try:
        import torch
    except ImportError:
        return None
    rows, inner, outer = shape
    generator = torch.Generator().manual_seed(0)
    x32, w32 = torch.randn(rows, inner, generator=generator), torch.randn(outer, inner, generator=generator)
    operands = {dtype: (x32.to(dtype), w32.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    onednn = torch.backends.mkldnn.is_available()

    def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if onednn:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return torch.nn.functional.linear(x, w)

    best = dict.fromkeys(operands, float("inf"))
    try:
        with torch.no_grad():
            for x, w in operands.values():  # oneDNN builds each primitive on its first call
                gemm(x, w)
            for _ in range(rounds):
                for dtype, (x, w) in operands.items():
                    start = time.perf_counter()
                    gemm(x, w)
                    best[dtype] = min(best[dtype], time.perf_counter() - start)
    except (RuntimeError, NotImplementedError) as exc:  # a torch build whose oneDNN lacks a dtype's kernel
        log.warning("precision = auto: timing bfloat16 GEMMs against float32 failed (%s); the CPU flags decide", exc)
        return None
    return best[torch.float32] / best[torch.bfloat16]


def choose_precision(
    *,
    device: str,
    cpu_flags: frozenset[str],
    true_on_policy: bool = False,
    engine_dtype: str = "auto",
    bf16_gemm_speedup: float | None = None,
) -> Choice:
    """What ``precision = "auto"`` becomes.

    Fidelity-sensitive settings keep float32: ``train.true_on_policy`` and ``rollout.engine_dtype =
    "float32"``. Otherwise ``bf16`` on CUDA and on a CPU with bfloat16 units (:data:`BF16_CPU_FLAGS`) whose
    bfloat16 GEMMs run at least :data:`BF16_TRAIN_SPEEDUP` times float32's (``bf16_gemm_speedup``, measured;
    ``None``: the flags decide), and ``fp32`` on other CPUs."""
    if true_on_policy:
        return Choice(
            "precision", "fp32", "auto: train.true_on_policy asks for fidelity first, so float32 (set bf16 to trade it)"
        )
    if engine_dtype == "float32":
        return Choice("precision", "fp32", "auto: rollout.engine_dtype = float32 asks for float32 weights")
    if device == "cuda":
        return Choice("precision", "bf16", "auto: CUDA GPUs compute in bfloat16 at full speed")
    units = [flag for flag in BF16_CPU_FLAGS if flag in cpu_flags]
    if not units:
        return Choice(
            "precision",
            "fp32",
            f"auto: the CPU has no bfloat16 units (no {' / '.join(BF16_CPU_FLAGS)} flag): bf16 would be emulated, "
            "slower than float32",
        )
    have = f"the CPU has bfloat16 units ({', '.join(units)})"
    if bf16_gemm_speedup is None:
        return Choice("precision", "bf16", f"auto: {have}, bf16 matmuls beat float32")
    measured = f"bf16 GEMMs run at {bf16_gemm_speedup:.2f}x float32's here (measured at start)"
    if bf16_gemm_speedup >= BF16_TRAIN_SPEEDUP:
        return Choice("precision", "bf16", f"auto: {have} and {measured}")
    return Choice(
        "precision",
        "fp32",
        f"auto: {have}, but {measured}, below the {BF16_TRAIN_SPEEDUP}x that bf16 training needs: the trainer "
        "computes in float32",
    )


def choose_engine_dtype(
    *,
    device: str,
    cpu_flags: frozenset[str],
    precision: str,
    true_on_policy: bool = False,
    engine_dtype: str = "auto",
    bf16_gemm_speedup: float | None = None,
) -> Choice | None:
    """What ``rollout.engine_dtype = "auto"`` becomes where ``precision = "auto"`` chose ``precision``; ``None``:
    it stays ``auto``, the precision recipe's dtype.

    ``bfloat16`` where the trainer computes in float32 only because this CPU's bfloat16 GEMMs are too slow to
    train in (:func:`choose_precision`): decoding reads the weights, a step at a time, and reads half the bytes
    in bfloat16 (the local engine's row kernel and SGLang's CPU kernels compute with the same bfloat16 units),
    so the engines serve bfloat16 while the trainer keeps float32. Not under ``train.true_on_policy``."""
    chosen = engine_dtype != "auto" or true_on_policy or device != "cpu" or precision != "fp32"
    has_units = any(flag in cpu_flags for flag in BF16_CPU_FLAGS)
    slow_bf16 = bf16_gemm_speedup is not None and bf16_gemm_speedup < BF16_TRAIN_SPEEDUP
    if chosen or not (has_units and slow_bf16):
        return None
    return Choice(
        "rollout.engine_dtype",
        "bfloat16",
        "auto: the trainer computes in float32 (bf16 GEMMs are slow here), but decoding reads every weight a "
        "step and the CPU has bfloat16 units: the engines serve bfloat16, half the bytes",
    )


# -------------------------------------------------------------------------------------------- transport
@dataclass(frozen=True)
class TransportFacts:
    """What ``transport = "auto"`` depends on, beyond the settings."""

    device: Literal["cpu", "cuda"] = "cpu"
    num_engines: int = 1
    colocate: bool = False
    engines_on_trainer_host: bool = True
    """Every engine runs on the host of the trainer ranks (the launcher places no process elsewhere)."""
    p2p_installed: bool = False
    """A ``p2p`` transport is registered (miles-p2p installed and loaded)."""
    engine_serves_p2p: bool = False
    """The rollout engine serves Miles' own weight routes (the local engine; SGLang does not)."""
    precision_sends_slices: bool = True
    """The precision recipe converts the trainer ranks' slices (every built-in one), as ``p2p`` needs."""
    adapter: bool = False
    """``train.adapter`` is set: pushes carry the adapter only."""
    lora_installed: bool = False
    """A ``lora`` transport is registered (miles-lora)."""


@dataclass(frozen=True)
class TransportCandidate:
    """One transport ``auto`` may choose: its name, its options and why it is the best left."""

    name: str
    reason: str
    options: Mapping[str, Any] = field(default_factory=dict)


def transport_candidates(facts: TransportFacts) -> list[TransportCandidate]:
    """The transports ``transport = "auto"`` tries, best first; the composition root takes the first that no
    component refuses (``check_settings``: ``broadcast`` refuses colocation on CUDA, the diffusion engine
    loads from disk only), so ``disk``, which every engine loads, ends the list.

    ``p2p`` over shared memory written into the engines' weights comes first where it works: every engine on
    the trainer's host, on a CPU, not colocated (a memory release moves the weights it writes into), the
    local engine, miles-p2p installed and a precision recipe that converts slices. Colocated local engines on
    CUDA take ``tensor_ipc`` (CUDA IPC from each trainer rank to the engine on its GPU)."""
    if facts.num_engines == 0:
        return [TransportCandidate("disk", "auto: cluster.num_engines = 0, no weights are pushed")]
    out: list[TransportCandidate] = []
    if facts.adapter and facts.lora_installed:
        out.append(TransportCandidate("lora", "auto: train.adapter is set, so pushes carry the adapter only"))
    why_not: list[str] = []
    if not facts.p2p_installed:
        why_not.append("miles-p2p is not installed")
    if not facts.engines_on_trainer_host:
        why_not.append("engines run on other hosts")
    if facts.device != "cpu":
        why_not.append("the weights live on the GPU, not in host memory")
    if facts.colocate:
        why_not.append("colocated engines release the weights p2p writes into")
    if not facts.engine_serves_p2p:
        why_not.append("the rollout engine does not serve p2p's routes")
    if not facts.precision_sends_slices:
        why_not.append("the precision recipe converts whole tensors only")
    if facts.adapter:
        why_not.append("train.adapter is set")
    if not why_not:
        out.append(
            TransportCandidate(
                "p2p",
                "auto: every engine is a local engine on the trainer's host, so the trainer writes straight into "
                "their weights in shared memory (p2p, datapath shm, write_into_weights)",
                {"datapath": "shm", "write_into_weights": True},
            )
        )
    if facts.colocate and facts.device == "cuda" and facts.engine_serves_p2p and not facts.adapter:
        out.append(
            TransportCandidate(
                "tensor_ipc",
                "auto: colocated engines on CUDA read each trainer rank's tensors in place (CUDA IPC), one engine "
                "TP rank per trainer rank",
            )
        )
    not_p2p = f" (not p2p over shared memory: {'; '.join(why_not)})" if why_not else ""
    out.append(TransportCandidate("broadcast", f"auto: one process group of rank 0 and the engines{not_p2p}"))
    out.append(TransportCandidate("disk", f"auto: the engines load safetensors rank 0 writes{not_p2p}"))
    return out


# ---------------------------------------------------------------------------------------------- threads
SPIN_COUNT = 100_000
"""``GOMP_SPINCOUNT`` of processes whose busy threads have their cores to themselves: an OpenMP thread that
reaches a barrier spins this many times (~3.5 ms on this project's AMD EPYC) before it sleeps. Long enough to
carry a thread from one operation of a step to the next without a sleep and a wake-up (a passive wait made
the SmolLM2 GRPO step 1.3-1.4x slower there: ``docs/benchmarks.md``), short enough that a side that has
finished its turn gives its cores back within milliseconds."""


@dataclass(frozen=True)
class ThreadSplit:
    """Torch threads of each trainer rank and each engine on CPU (``None``: left to torch, on CUDA), and how
    their OpenMP threads wait."""

    trainer: int | None
    engine: int | None
    reason: str
    spin: bool = False
    """Whether OpenMP threads spin briefly at barriers (:data:`SPIN_COUNT`) rather than sleep at once: only
    where the threads that compute at the same time fit in the cores."""
    wait_reason: str = ""

    def line(self) -> str:
        if self.trainer is None:
            return f"threads: {self.reason}"
        wait = f"; {self.wait_reason}" if self.wait_reason else ""
        return f"threads: {self.trainer} per trainer rank, {self.engine} per engine: {self.reason}{wait}"

    def wait_env(self, environ: Mapping[str, str], *, busy: bool = False) -> dict[str, str]:
        """The OpenMP wait variables of a child process: a short spin (``GOMP_SPINCOUNT``) where :attr:`spin`
        and the machine was not ``busy`` with other processes when the run started, else
        ``OMP_WAIT_POLICY=PASSIVE`` (a thread that spins at a barrier takes a core from the thread it waits
        for whenever another process competes for the cores); nothing where the user set either variable."""
        if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
            return {}
        if self.spin and not busy:
            return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
        return {"OMP_WAIT_POLICY": "PASSIVE"}


def split_threads(
    *,
    mode: str,
    cores: int,
    trainer_ranks: int,
    num_engines: int,
    device: str = "cpu",
    environ: Mapping[str, str] | None = None,
) -> ThreadSplit:
    """The torch threads ``miles train`` gives its children on CPU, and whether their OpenMP threads spin.

    In ``sync`` mode the engines and the trainer ranks take turns, so each side may use every core (the
    trainer ranks split them, and so do the engines, which decode at the same time); in the async modes they
    run at once and every process gets its own share. The ``MILES_TORCH_THREADS`` environment variable, set
    by the user, wins (``OMP_NUM_THREADS`` sets the OpenMP pools' size only). OpenMP threads spin briefly at
    barriers (:data:`SPIN_COUNT`) where the threads that compute at the same time fit in ``cores``, and wait
    passively otherwise, or where ``OMP_NUM_THREADS`` sizes the pools from outside."""
    if device != "cpu":
        return ThreadSplit(None, None, "on CUDA the GPUs compute; torch's CPU threads are left at its default")
    env = environ if environ is not None else {}
    if mode == "sync":
        trainer, engine = max(1, cores // max(trainer_ranks, 1)), max(1, cores // max(num_engines, 1))
        reason = f"sync: engines and trainer take turns, so each side uses all {cores} cores"
        sharing = [f"the {n} {who}" for n, who in ((trainer_ranks, "trainer ranks"), (num_engines, "engines")) if n > 1]
        if sharing:
            reason += f" ({' and '.join(sharing)} {'each ' if len(sharing) > 1 else ''}split them)"
    else:
        processes = max(trainer_ranks + num_engines, 1)
        trainer = engine = max(1, cores // processes)
        reason = f"{mode}: engines and trainer run at once, so the {processes} processes split the {cores} cores"
    user = env.get("MILES_TORCH_THREADS")
    if user:
        trainer = engine = int(user)
        reason = f"MILES_TORCH_THREADS={user} set in the environment"
    if mode == "sync":
        busy = max(trainer * trainer_ranks, engine * num_engines)
    else:
        busy = trainer * trainer_ranks + engine * num_engines
    if env.get("OMP_NUM_THREADS"):
        if not user:
            reason += f"; OMP_NUM_THREADS={env['OMP_NUM_THREADS']} from the environment sizes the OpenMP pools"
        spin, wait = False, "OpenMP threads wait passively (the pools' size is set from outside)"
    elif busy <= cores:
        spin = True
        wait = f"OpenMP threads spin briefly between operations (GOMP_SPINCOUNT={SPIN_COUNT}): {busy} busy at once for {cores} cores"
    else:
        spin = False
        wait = f"OpenMP threads wait passively: {busy} threads busy at once for {cores} cores"
    return ThreadSplit(trainer, engine, reason, spin, wait)
