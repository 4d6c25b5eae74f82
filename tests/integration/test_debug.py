"""``miles train --debug``: the engine, the driver and the trainer in one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.testing.runs import children_of_run, read_metrics, run_miles, write_run_config

pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[2]


PID_PROBE = """
import os, threading
from miles.rollout.manager import single_turn

async def probe(client, sample, sampling_params):
    out = await single_turn(client, sample, sampling_params)
    out.metadata["pid"] = os.getpid()
    out.metadata["threads"] = sorted({t.name for t in threading.enumerate()})
    return out
"""


def test_debug_mode_runs_engine_driver_and_trainer_in_one_process(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    """``miles train --debug``: nothing is launched; the rollout function (like any plugin code) runs in the
    process that was started, next to the in-process engine's threads, so a debugger stops there."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "pid_probe.py").write_text(PID_PROBE)
    run_dir = tmp_path / "debug"
    config = write_run_config(tmp_path, tiny_model, prompts, run_dir, ranks=1, transport="disk", rollouts=2)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles", "train", str(config), "--debug", "--set", 'rollout.function="pid_probe:probe"'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert all(r["weight_sync/verified"] == 1.0 for r in read_metrics(run_dir))
    from miles.types import Sample

    samples = [
        Sample.from_json(line) for line in (run_dir / "samples" / "rollout_000002.jsonl").read_text().splitlines()
    ]
    assert {s.metadata["pid"] for s in samples} == {proc.pid}
    assert "miles-engine-http" in samples[0].metadata["threads"]
    assert not (run_dir / "logs").exists()  # no process was launched
    assert children_of_run(run_dir) == []
    two_ranks = run_miles("train", str(config), "--debug", "--overwrite", "--set", "cluster.trainer_ranks=2")
    assert two_ranks.returncode == 2 and "cluster.trainer_ranks: --debug runs one trainer rank" in two_ranks.stderr
