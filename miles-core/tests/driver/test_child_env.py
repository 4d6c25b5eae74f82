"""The environment ``miles train`` gives its children: torch threads, OpenMP's wait and, on CPU, the trainers'
malloc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from miles.host.train import KEEP_MALLOC_TUNABLES, _child_env
from miles.settings.model import MilesSettings

# RSS growth of a process that allocates 64 MiB, writes it, frees it: kept (the heap holds it for the next
# step) or given back (glibc maps a block that size on its own and unmaps it at free)
_PROBE = """
import os
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
block = bytearray(64 << 20)
block[::4096] = b"x" * len(block[::4096])
del block
print(rss() - before)
"""


def _kept_after_free(env: dict[str, str]) -> int:
    clean = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def _clear_malloc_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key == "GLIBC_TUNABLES" or key.startswith("MALLOC_"):
            monkeypatch.delenv(key)


def test_cpu_trainers_keep_freed_memory_and_engines_keep_glibc_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_malloc_env(monkeypatch)
    settings = MilesSettings()
    assert _child_env(settings)["GLIBC_TUNABLES"] == KEEP_MALLOC_TUNABLES
    assert "GLIBC_TUNABLES" not in _child_env(settings, role="engine")
    settings.cluster.trainer_malloc = "system"
    assert "GLIBC_TUNABLES" not in _child_env(settings)
    settings.cluster.trainer_malloc = "keep"
    settings.cluster.device = "cuda"
    assert "GLIBC_TUNABLES" not in _child_env(settings)


def test_the_users_malloc_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_malloc_env(monkeypatch)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert "GLIBC_TUNABLES" not in _child_env(MilesSettings())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_glibc_honours_the_tunables_a_freed_block_stays_mapped() -> None:
    """What ``keep`` is for: with glibc's defaults a 64 MiB block is mapped on its own and given back at
    free (the next step maps and page-faults it again); with the trainers' tunables it stays."""
    assert _kept_after_free({}) < 8 << 20
    assert _kept_after_free({"GLIBC_TUNABLES": KEEP_MALLOC_TUNABLES}) > 56 << 20


_HELPER_PROBE = """
import threading, torch
from miles.torch_threads import single_threaded_here
torch.set_num_threads(2)
seen = {}
def helper():
    single_threaded_here()
    seen["helper"] = torch.get_num_threads()
    torch.ones(1 << 20).sum()  # a parallel region on the helper
def later():
    seen["later"] = torch.get_num_threads()  # a thread initialised afterwards takes the process's count
for target in (helper, later):
    t = threading.Thread(target=target); t.start(); t.join()
print(seen["helper"], torch.get_num_threads(), seen["later"])
"""


def test_a_helper_thread_runs_single_threaded_without_lowering_the_process_count() -> None:
    """``single_threaded_here``: the helper runs on one thread; the main thread keeps 2, and so does a thread
    initialised afterwards (``torch.set_num_threads(1)`` in the helper would have lowered that one to 1)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _HELPER_PROBE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "2", "2"]


# CPU seconds a process burns while it sleeps 0.05 s after each of 40 two-thread matmuls: OpenMP's worker
# spinning at the barrier before it sleeps (a passive wait sleeps at once)
_SPIN_PROBE = """
import time, torch
torch.set_num_threads(2)
a = torch.randn(1000, 1000)
a @ a
burned = 0.0
for _ in range(40):
    a @ a
    start = time.process_time()
    time.sleep(0.05)
    burned += time.process_time() - start
print(burned)
"""


def _burned_while_idle(env: dict[str, str]) -> float:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", _SPIN_PROBE], env={**clean, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: no OpenMP worker thread to wait")
def test_on_an_idle_machine_threads_spin_briefly_and_on_a_busy_one_they_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.defaults import SPIN_COUNT
    from miles.launch import contention

    for key in ("OMP_NUM_THREADS", "MILES_TORCH_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr("miles.defaults.usable_cores", lambda: 2)
    monkeypatch.setattr(contention, "_free_cores", 1.9)  # other processes left the cores free
    idle = _child_env(MilesSettings())
    assert idle["GOMP_SPINCOUNT"] == str(SPIN_COUNT) and "OMP_WAIT_POLICY" not in idle
    assert _child_env(MilesSettings(), role="engine")["GOMP_SPINCOUNT"] == str(SPIN_COUNT)
    monkeypatch.setattr(contention, "_free_cores", 1.0)  # another process kept a core busy
    busy = _child_env(MilesSettings())
    assert busy["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in busy
    # libgomp does as told: the spinning worker burns CPU after each operation, the passive one next to none.
    # How long 100000 spins take is the host's (0.2 ms to 3.5 ms an operation on this project's hosts: a CI host
    # burned 2.0 ms over 10 operations against 0.5 ms passive), so the spin is judged against the passive wait
    # measured beside it, over 40 operations, not against a clock
    spun = _burned_while_idle({"GOMP_SPINCOUNT": idle["GOMP_SPINCOUNT"], "OMP_NUM_THREADS": "2"})
    slept = _burned_while_idle({"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2"})
    assert spun > 2 * slept, (spun, slept)
