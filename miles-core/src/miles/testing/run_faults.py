"""Faults injected into a running ``miles train``: a trainer rank or an engine killed at a chosen moment, the
run held (a gate reward) until a restarted engine serves, so that failover tests do not depend on the
machine's speed. Used by Miles' own integration suites; a plugin's tests can use them the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from miles.testing.runs import children_of_run

__all__ = [
    "GATE",
    "engine_pid",
    "gated",
    "kill_in_push_then_hold_until_restarted",
    "kill_rank_after",
    "kill_then_hold_until_restarted",
    "rank_pid",
    "serves",
    "train_injecting",
]


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The PID of trainer rank ``rank`` of the run (its environment says ``RANK``)."""
    for pid in children_of_run(run_dir):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"miles.driver.worker" in cmdline and f"RANK={rank}".encode() in environ:
            return pid
    return None


def engine_pid(run_dir: Path, index: int) -> int | None:
    """The PID of engine ``index`` of the run (found by the port of its URL in ``fleet.json``)."""
    try:
        url = json.loads((run_dir / "fleet.json").read_text())["engine_urls"][index]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    port = f"--port {url.rsplit(':', 1)[1]} ".encode()
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ") + b" "
        except OSError:
            continue
        if entry.name.isdigit() and b"miles.engine" in cmdline and port in cmdline:
            return int(entry.name)
    return None


def kill_rank_after(
    config: Path, run_dir: Path, *, rank: int, when: Path, timeout: float = 600
) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Run ``miles train config``, SIGKILL trainer rank ``rank`` once ``when`` exists; the kill's time and the
    finished process."""
    import signal

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles", "train", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + timeout
    killed_at = None
    try:
        while killed_at is None and proc.poll() is None and time.monotonic() < deadline:
            pid = rank_pid(run_dir, rank) if when.exists() else None
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed_at is not None, f"rank {rank} was never killed (run ended with {proc.returncode}): {stderr[-2000:]}"
    return killed_at, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def train_injecting(
    config: Path, run_dir: Path, inject: Callable[[int], bool], env: dict[str, str] | None = None
) -> tuple[bool, int, str]:
    """``miles train config``, polling ``inject(steps_logged)`` until it returns ``True`` (the fault went in);
    returns whether it did, the exit code and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles", "train", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    injected = False
    deadline = time.monotonic() + 400
    try:
        metrics_file = run_dir / "metrics.jsonl"
        while not injected and proc.poll() is None and time.monotonic() < deadline:
            steps = len(metrics_file.read_text().splitlines()) if metrics_file.exists() else 0
            injected = bool(inject(steps))
            time.sleep(0.02)
        _, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return injected, int(proc.returncode), stderr


GATE = """
import asyncio
import os

from miles.components import ComponentSettings
from miles.markers import hookimpl
from miles.rewards.base import Reward


class GateSettings(ComponentSettings):
    path: str


class Gate(Reward[GateSettings]):
    '''Scores 0; while the file ``path`` exists it waits for it to go (a test holds the run's rollout).'''

    name = "gate"

    async def score(self, sample):
        while os.path.exists(self.settings.path):
            await asyncio.sleep(0.05)
        return 0.0


@hookimpl
def miles_register_rewards(register):
    register(Gate)
"""


def gated(tmp_path: Path, config: Path) -> tuple[Path, dict[str, str]]:
    """Add the ``gate`` reward (weight 0) to ``config``: while the returned file exists, the run's scoring,
    and so its next step, waits. Returns the file and the environment that loads the plugin."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "miles_gate.py").write_text(GATE)
    info = site / "miles_gate-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-gate\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[miles.plugins]\ngate = miles_gate\n")
    gate = tmp_path / "gate"
    text = config.read_text().replace(
        "[transport]", f'[[reward.functions]]\nname = "gate"\nweight = 0.0\npath = "{gate}"\n\n[transport]'
    )
    config.write_text(text.replace("[algorithm]", "[reward]\ntimeout = 600\n\n[algorithm]"))
    return gate, {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def serves(url: str) -> bool:
    """Whether the engine at ``url`` answers ``/health``."""
    import httpx

    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def kill_then_hold_until_restarted(
    run_dir: Path, gate: Path, kill: Callable[[], object], died: Callable[[], bool] = lambda: True
) -> Callable[[int], bool]:
    """The fault for :func:`train_injecting` in a run with 2 engines: once step 2 is logged, ``kill()``; once
    an engine ``died()``, hold the run (``gate``: the next scoring waits) until the launcher's restart of it
    serves, so that the restarted engine rejoins at the next push however slow the machine. Done (``True``)
    when the gate opens again."""
    pids: dict[int, int | None] = {}

    def step(steps: int) -> bool:
        if steps < 2:
            return False
        if not pids:
            pids.update({i: engine_pid(run_dir, i) for i in (0, 1)})
            kill()
            return False
        if not died():
            return False
        gate.touch()
        urls = json.loads((run_dir / "fleet.json").read_text())["engine_urls"]
        restarted = [i for i in (0, 1) if engine_pid(run_dir, i) not in (None, pids[i])]
        if restarted and all(serves(urls[i]) for i in restarted):
            gate.unlink()
            return True
        return False

    return step


def kill_in_push_then_hold_until_restarted(run_dir: Path, trigger: Path, gate: Path) -> Callable[[int], bool]:
    """:func:`kill_then_hold_until_restarted` with ``MILES_TEST_SIGKILL_IN_PUSH`` armed once step 2 is logged:
    the engine that takes ``trigger`` dies in the next push."""
    return kill_then_hold_until_restarted(run_dir, gate, trigger.touch, lambda: not trigger.exists())
