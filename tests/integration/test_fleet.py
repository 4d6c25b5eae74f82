"""Engines that join and leave while a run goes on (``miles fleet add|remove``): a GRPO run starts with one
engine; once it has trained a step, ``miles fleet add`` starts a second, which takes the next weight push
(verified) and then serves; ``miles fleet remove engine-0`` drains the first (no new requests, those in flight
finish) and stops it (both asked at once: the fleet takes one request at a time). The run finishes its
steps with every sample of every step generated and trained (counted: none failed, none missing), every push
verified, and the samples say which engine made each: the first only before, the second only after. In
``sync`` mode behind the smg router, with the run's API key and admin key (issue 46: the new engine gets them,
its cache flush and smg's ``/workers``, where it is registered and the old one drained, are sent the admin
key), and in ``one_step_off`` mode with the client's own routing and pushes committed while the next step
trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.testing.runs import children_of_run, paced_reward, read_metrics, run_miles, write_run_config

pytestmark = pytest.mark.slow


ROOT = Path(__file__).resolve().parents[2]

GROUPS_PER_STEP, SAMPLES_PER_STEP = 4, 16  # 4 prompts x 4 samples (write_run_config)

# (TOML appended to the run's settings, miles train options, steps). A reward server paces each step to 2 s
# or more until both changes are done (an engine takes 15-30 s to start on 2 busy cores), so they are done
# mid-run whatever the load; the run then finishes at full speed
MODES = {
    "sync-smg-keyed": ('\n[rollout.router]\nname = "smg"\nhealth_check_interval = 1\n', [], 24),
    "one_step_off": ("", ["--set", "rollout.mode=one_step_off"], 40),
}
KEYS = {"MILES_API_KEY": "fleet-api-key-5d1e", "MILES_ADMIN_API_KEY": "fleet-admin-key-93b0"}
"""The keyed mode's keys, in the environment of ``miles train`` (never in its settings file)."""


def run_with_fleet_changes(
    config: Path, run_dir: Path, options: list[str], gate: Path, *, env: dict[str, str], timeout: float = 900
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """``miles train config``; after its first step ``miles fleet add`` (not followed), then ``miles fleet remove
    engine-0`` (followed to its end), then ``gate`` opened (the paced reward lets the run go at full speed);
    returns the three processes' outcomes, the run's last."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles", "train", str(config), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if (run_dir / "metrics.jsonl").exists() and read_metrics(run_dir):
                break
            time.sleep(0.2)
        # (one request at a time, in order: the removal starts once the new engine serves)
        add = run_miles("fleet", "add", str(run_dir), "--no-wait")
        remove = run_miles("fleet", "remove", str(run_dir), "engine-0", "--timeout", "300")
        gate.touch()
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return add, remove, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("mode", list(MODES))
def test_an_engine_added_and_one_removed_mid_run_lose_no_sample(
    mode: str, tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    run_dir = tmp_path / "run"
    transport = "disk" if mode == "one_step_off" else "broadcast"
    extra, options, steps = MODES[mode]
    gate = tmp_path / "changes-done"
    server, paced = paced_reward(gate)
    try:
        config = write_run_config(
            tmp_path, tiny_model, prompts, run_dir, extra + paced, ranks=1, transport=transport, rollouts=steps
        )
        keys = KEYS if mode.endswith("keyed") else {}
        add, remove, out = run_with_fleet_changes(config, run_dir, options, gate, env=keys)
    finally:
        server.kill()
        server.communicate()
    said = out.stdout[-3000:] + out.stderr[-5000:]
    assert add.returncode == 0, add.stdout + add.stderr + said
    assert remove.returncode == 0, remove.stdout + remove.stderr + said
    assert out.returncode == 0, said

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:  # every group of every step generated, none failed (the samples are counted below)
        assert row["rollout/groups_generated"] == GROUPS_PER_STEP and row["rollout/failed_fraction"] == 0.0, row
    # every push verified (one_step_off commits while the next step trains: its check is logged a step later)
    checks = [r["weight_sync/verified"] for r in rows if "weight_sync/verified" in r]
    assert checks == [1.0] * len(checks) and len(checks) >= steps - (mode == "one_step_off"), rows
    assert sum(r.get("fleet/engines_added", 0.0) for r in rows) == 1.0
    assert sum(r.get("fleet/engines_removed", 0.0) for r in rows) == 1.0
    if mode == "sync-smg-keyed":  # every request went through the router, before and after the changes
        assert all(r["rollout/routed_requests"] == SAMPLES_PER_STEP for r in rows), rows

    fleet = json.loads((run_dir / "fleet.json").read_text())
    old, new = _engines(run_dir)
    assert fleet["engine_urls"] == [new] and not fleet["joining"] and not fleet["draining"]
    # which engine made each sample: engine-0 alone first, both for a while, engine-1 alone at the end
    served = []
    for dump in sorted((run_dir / "samples").glob("rollout_*.jsonl")):
        samples = [json.loads(line) for line in dump.read_text().splitlines()]
        assert len(samples) == SAMPLES_PER_STEP, dump
        assert all(s["status"] in ("completed", "truncated") for s in samples), dump
        served.append({s["metadata"]["engine_url"] for s in samples})
    assert served[0] == {old} and served[-1] == {new}, served
    assert any(new in engines for engines in served[:-1]), served  # it served before the run's last step
    assert children_of_run(run_dir) == []
    if keys:  # no key in the run directory (settings, logs, fleet requests and reports)
        holding = [
            str(path.relative_to(run_dir))
            for path in run_dir.rglob("*")
            if path.is_file() and any(key.encode() in path.read_bytes() for key in keys.values())
        ]
        assert not holding, holding


def _engines(run_dir: Path) -> tuple[str, str]:
    """The URLs of engine-0 and engine-1 (from the fleet requests' statuses)."""
    statuses = [json.loads(p.read_text()) for p in sorted((run_dir / "fleet" / "requests").glob("*.status.json"))]
    added = next(s["url"] for s in statuses if s["action"] == "add")
    removed = next(s["url"] for s in statuses if s["action"] == "remove")
    assert all(s["state"] == "done" for s in statuses), statuses
    return removed, added
