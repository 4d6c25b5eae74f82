"""Is this run getting the CPU it asks for? A check of the launching host, from ``/proc``.

On a CPU, a run shares the machine's cores with whatever else runs there. Another busy process makes every
step slower, and OpenMP makes it much slower than the share the run loses: each of torch's thousands of
small parallel regions per step ends in a barrier that waits for its slowest thread, and a thread the
scheduler has just handed to another process stalls the whole region for a scheduler slice. Measured on
the 2-core development machine, one busy two-thread neighbour turned 4.5 s quickstart steps into 55-82 s
(issue 42; docs/benchmarks.md, "Sharing the CPU with another job", compares the old and the new setup).

Two things follow. Before a run starts, :func:`check_start` measures what the other processes of the
machine use (half a second of ``/proc/stat``) and says so when the machine is already busy; the children then
get as many torch threads as cores are left (:func:`free_cores`, read by the launcher when it builds their
environment) and a passive OpenMP wait policy, so that an oversubscribed run slows down in proportion to the
CPU it gets instead of stalling in barriers. While the run trains, :class:`ContentionWatch` compares the CPU
time of the run's processes with the wall time and the machine's busy time every few steps, and says once,
with the figures, when other processes are taking the cores.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ContentionWatch", "CpuSample", "Share", "check_start", "free_cores", "sample", "share_between"]

log = logging.getLogger(__name__)

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
STARVED_OTHERS = 0.5
"""Cores other processes must take (on a saturated machine) before a run counts as starved."""
SATURATED = 0.85
"""Fraction of the machine's cores busy at which it counts as saturated."""


@dataclass(frozen=True)
class CpuSample:
    """One reading: the wall clock, the CPU seconds of a process tree, the machine's busy CPU seconds."""

    wall: float
    """``time.monotonic()``."""
    tree_cpu: float
    """User + system CPU seconds of the process and its live descendants (reaped children included
    through their parents' ``cutime``)."""
    machine_busy: float
    """CPU seconds every core of the machine spent not idle (``/proc/stat``: user, nice, system, irq,
    softirq, steal)."""
    load: float
    """The one-minute load average."""


@dataclass(frozen=True)
class Share:
    """What a process tree and everything else got of the machine between two samples."""

    seconds: float
    cores: int
    run: float
    """Cores the run used on average."""
    others: float
    """Cores every other process used on average."""
    load: float

    @property
    def starved(self) -> bool:
        """The machine was saturated and other processes took at least :data:`STARVED_OTHERS` cores."""
        return self.others >= STARVED_OTHERS and self.run + self.others >= SATURATED * self.cores

    def describe(self) -> str:
        return (
            f"over {self.seconds:.0f} s this run got {self.run:.1f} of the machine's {self.cores} cores and other "
            f"processes took {self.others:.1f} (load average {self.load:.1f})"
        )


def _machine_busy() -> float:
    with open("/proc/stat", encoding="ascii") as f:
        fields = f.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK


def _process_table() -> dict[int, tuple[int, float]]:
    """``{pid: (parent pid, CPU seconds: utime + stime + cutime + cstime)}`` of every live process."""
    table: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text(encoding="ascii", errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = raw[raw.rfind(")") + 2 :].split()  # after "pid (comm) ": the name may hold spaces
        parent = int(fields[1])
        utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
        table[int(entry.name)] = (parent, (utime + stime + cutime + cstime) / _TICK)
    return table


def sample(root: int | None = None) -> CpuSample:
    """Read the machine and the process tree of ``root`` (default this process)."""
    root = os.getpid() if root is None else root
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            total += table[pid][1]
        todo.extend(children.get(pid, ()))
    return CpuSample(time.monotonic(), total, _machine_busy(), os.getloadavg()[0])


def share_between(first: CpuSample, second: CpuSample, cores: int | None = None) -> Share:
    """What the tree and the rest of the machine used between two samples."""
    cores = cores or os.cpu_count() or 1
    seconds = max(second.wall - first.wall, 1e-6)
    run = max(0.0, second.tree_cpu - first.tree_cpu) / seconds
    busy = max(0.0, second.machine_busy - first.machine_busy) / seconds
    return Share(seconds, cores, min(run, busy), max(0.0, busy - run), second.load)


_free_cores: float | None = None


def free_cores() -> float | None:
    """Cores the other processes left free when :func:`check_start` last measured (``None``: not measured,
    take every core)."""
    return _free_cores


def check_start(seconds: float = 0.5) -> Share | None:
    """Measure what the machine's other processes use for ``seconds`` before a run starts its children;
    remember the cores they leave (:func:`free_cores`) and warn when the machine is already busy. ``None``
    where ``/proc`` cannot be read."""
    global _free_cores
    try:
        first = sample()
        time.sleep(seconds)
        share = share_between(first, sample())
    except (OSError, ValueError, IndexError):
        return None
    _free_cores = max(1.0, share.cores - share.others)
    if share.starved:
        given = [f"{var}={os.environ[var]}" for var in ("OMP_NUM_THREADS", "MILES_TORCH_THREADS") if var in os.environ]
        threads = (
            f"keep the thread count of the environment ({', '.join(given)})"
            if given
            else f"get {max(1, round(_free_cores))} torch thread(s) each"
        )
        log.warning(
            "the machine is busy before this run starts: other processes use %.1f of its %d cores (load average "
            "%.1f); the run's processes %s and its steps will be slower than on an idle machine",
            share.others,
            share.cores,
            share.load,
            threads,
        )
    return share


class ContentionWatch:
    """Every ``every`` steps, the CPU the run's processes got against the wall time and the machine's busy
    time; says once (a warning) when other processes are taking the cores, with the figures."""

    def __init__(self, *, every: int = 3, root: int | None = None, warned: bool = False) -> None:
        self.every = every
        self.root = root
        self.warned = warned
        """Whether the run was already told (a busy start counts)."""
        self.shares: list[Share] = []
        """Every window measured, in order."""
        self._last: CpuSample | None = None
        self._last_step = 0
        self._start()

    def _start(self) -> None:
        try:
            self._last = sample(self.root)
        except (OSError, ValueError, IndexError):
            self._last = None

    def step(self, step: int) -> Share | None:
        """Call with each step logged; measures the window since the last measurement every ``every``
        steps (the first one at step ``every``)."""
        if self._last is None or step - self._last_step < self.every:
            return None
        try:
            now = sample(self.root)
        except (OSError, ValueError, IndexError):
            return None
        share = share_between(self._last, now)
        self._last, self._last_step = now, step
        self.shares.append(share)
        if share.starved and not self.warned:
            self.warned = True
            log.warning(
                "this run is short of CPU: %s; its steps take longer than on an idle machine (steps %d-%d)",
                share.describe(),
                step - self.every + 1,
                step,
            )
        return share
