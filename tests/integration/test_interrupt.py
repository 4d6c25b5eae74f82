"""Ctrl-C on ``miles train``: every process stops and nothing the run only needed while it ran is left behind
(the disk transport's weight versions, hundreds of MB for a real model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.testing.runs import children_of_run, write_run_config

pytestmark = pytest.mark.slow


def test_ctrl_c_leaves_no_weight_scratch(tmp_path: Path, tiny_model: Path, arithmetic_prompts: Path) -> None:
    run_dir = tmp_path / "run"
    config = write_run_config(tmp_path, tiny_model, arithmetic_prompts, run_dir, ranks=1, transport="disk", rollouts=50)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles", "train", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 300
        while not any((run_dir / "weights").glob("v*")):  # a push has written a version
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no weight version was written"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the foreground process
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert not (run_dir / "weights").exists(), sorted(p.name for p in (run_dir / "weights").iterdir())
    assert (run_dir / "metrics.jsonl").exists() or (run_dir / "logs").exists()  # what the run produced stays
    assert children_of_run(run_dir) == [], stderr[-2000:]
