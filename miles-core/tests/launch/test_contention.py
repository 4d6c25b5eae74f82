"""The contention check: the CPU a run's process tree got against the wall time and the machine's busy time,
the warning said once with the figures, and the thread counts of a run that starts on a busy machine."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from miles.launch import contention
from miles.launch.contention import ContentionWatch, CpuSample, check_start, free_cores, sample, share_between


def test_the_shares_of_the_run_and_of_the_other_processes() -> None:
    first = CpuSample(wall=100.0, tree_cpu=50.0, machine_busy=1000.0, load=3.5)
    # 10 s: the run used 8 CPU seconds, the machine 19: others took 1.1 cores of 2
    starved = share_between(first, CpuSample(110.0, 58.0, 1019.0, 3.9), cores=2)
    assert (starved.run, round(starved.others, 3), starved.seconds) == (0.8, 1.1, 10.0)
    assert starved.starved
    assert starved.describe() == (
        "over 10 s this run got 0.8 of the machine's 2 cores and other processes took 1.1 (load average 3.9)"
    )
    # an idle neighbour, or a busy one on a machine with cores to spare, is no contention
    assert not share_between(first, CpuSample(110.0, 69.0, 1020.0, 2.0), cores=2).starved
    assert not share_between(first, CpuSample(110.0, 58.0, 1019.0, 3.9), cores=8).starved


def test_a_sample_counts_the_cpu_of_the_tree_and_of_the_machine() -> None:
    """A child that spins for a second, reaped meanwhile: its CPU time is the tree's (through this process's
    ``cutime``) and the machine's."""
    before = sample()
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\nprint(time.process_time())"
    used = float(subprocess.run([sys.executable, "-c", spin], capture_output=True, text=True, check=True).stdout)
    after = sample()
    assert after.tree_cpu - before.tree_cpu >= used - 0.05
    assert after.machine_busy - before.machine_busy >= used - 0.05
    assert after.wall > before.wall and after.load >= 0


def _samples(monkeypatch: pytest.MonkeyPatch, readings: list[CpuSample]) -> None:
    feed: Iterator[CpuSample] = iter(readings)
    monkeypatch.setattr(contention, "sample", lambda root=None: next(feed))
    monkeypatch.setattr(contention.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(contention.os, "cpu_count", lambda: 2)


def test_a_starved_run_is_told_once_with_the_figures(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    readings = [CpuSample(0.0, 0.0, 0.0, 1.0)]
    readings += [CpuSample(10.0 * i, 19.0 * i, 20.0 * i, 1.0) for i in (1, 2)]  # the run has the machine
    readings += [CpuSample(20.0 + 10.0 * i, 38.0 + 8.0 * i, 40.0 + 19.0 * i, 4.0) for i in (1, 2)]  # it has not
    _samples(monkeypatch, readings)
    with caplog.at_level(logging.WARNING, logger="miles.launch.contention"):
        watch = ContentionWatch(every=3)
        measured = [watch.step(step) for step in range(1, 13)]
    assert [step for step, share in enumerate(measured, start=1) if share is not None] == [3, 6, 9, 12]
    assert [share.starved for share in watch.shares] == [False, False, True, True]
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "this run is short of CPU: over 10 s this run got 0.8 of the machine's 2 cores and other processes took "
        "1.1 (load average 4.0); its steps take longer than on an idle machine (steps 7-9)"
    ]


def test_a_run_that_starts_on_a_busy_machine_takes_the_cores_left(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from miles.host.train import _child_env
    from miles.settings.model import MilesSettings

    monkeypatch.setattr(contention, "_free_cores", None)
    for key in ("OMP_NUM_THREADS", "MILES_TORCH_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(key, raising=False)
    assert free_cores() is None
    assert _child_env(MilesSettings(), role="engine")["OMP_NUM_THREADS"] == "2"
    # one second in which other processes kept 1.9 of the 2 cores busy
    _samples(monkeypatch, [CpuSample(0.0, 0.1, 0.0, 2.1), CpuSample(1.0, 0.1, 1.9, 2.2)])
    with caplog.at_level(logging.WARNING, logger="miles.launch.contention"):
        share = check_start()
    assert share is not None and share.starved and free_cores() == 1.0
    assert (
        caplog.records[0]
        .getMessage()
        .startswith(
            "the machine is busy before this run starts: other processes use 1.9 of its 2 cores (load average 2.2)"
        )
    )
    assert "the run's processes get 1 torch thread(s) each" in caplog.records[0].getMessage()
    env = _child_env(MilesSettings(), role="engine")
    assert (env["OMP_NUM_THREADS"], env["MILES_TORCH_THREADS"], env["OMP_WAIT_POLICY"]) == ("1", "1", "PASSIVE")
    # what the user sets wins, and the warning says so
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    env = _child_env(MilesSettings(), role="engine")
    assert env["OMP_NUM_THREADS"] == "2" and "OMP_WAIT_POLICY" not in env
    _samples(monkeypatch, [CpuSample(0.0, 0.1, 0.0, 2.1), CpuSample(1.0, 0.1, 1.9, 2.2)])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="miles.launch.contention"):
        check_start()
    said = caplog.records[0].getMessage()
    assert "the run's processes keep the thread count of the environment (OMP_NUM_THREADS=2)" in said, said
