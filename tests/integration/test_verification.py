"""Verification by logprobs (``transport.verify_with = "logprobs"``): how a push to an engine that reports no
tensors (SGLang on Qwen2, Qwen3, Qwen3-MoE) is checked. The engines' logprobs of a fixed probe must equal the
trainer's: a run whose pushes are complete passes every step; a push that leaves one tensor random is
stopped, naming the engine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles.testing.runs import children_of_run, read_metrics, run_miles, write_run_config

pytestmark = pytest.mark.slow

LOGPROBS = """
[rollout.engine]
name = "local"
enable_debug_endpoints = true
"""

SKIPPING = """
from miles.markers import hookimpl
from miles.transport.disk import DiskTransport


class SkippingDisk(DiskTransport):
    '''Drops model.norm.weight from every push: what verification exists to catch.'''

    name = "skipping_disk"

    async def stage(self, buckets, **kwargs):
        return await super().stage(([(n, t) for n, t in b if n != "model.norm.weight"] for b in buckets), **kwargs)


@hookimpl
def miles_register_transports(register):
    register(SkippingDisk)
"""


def test_complete_pushes_pass_the_probe(tmp_path: Path, tiny_model: Path, arithmetic_prompts: Path) -> None:
    run_dir = tmp_path / "run"
    options = 'verify_with = "logprobs"\nrandomize_engines_first = true'
    config = write_run_config(
        tmp_path, tiny_model, arithmetic_prompts, run_dir, LOGPROBS, ranks=2, transport_options=options, rollouts=2
    )
    out = run_miles("train", str(config))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for row in read_metrics(run_dir):
        assert row["weight_sync/verified"] == 1.0
        assert 0.0 <= row["weight_sync/verified_logprob_diff"] < 1e-3  # the same weights (float32 both sides)
        assert "weight_sync/verified_tensors" not in row


def test_a_push_that_misses_a_tensor_fails_the_probe(
    tmp_path: Path, tiny_model: Path, arithmetic_prompts: Path
) -> None:
    site = tmp_path / "site"
    (site / "miles_skipping-0.1.dist-info").mkdir(parents=True)
    (site / "miles_skipping.py").write_text(SKIPPING)
    info = site / "miles_skipping-0.1.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-skipping\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[miles.plugins]\nskipping = miles_skipping\n")
    run_dir = tmp_path / "run"
    options = 'verify_with = "logprobs"\nrandomize_engines_first = true'
    config = write_run_config(
        tmp_path,
        tiny_model,
        arithmetic_prompts,
        run_dir,
        LOGPROBS,
        ranks=1,
        transport="skipping_disk",
        transport_options=options,
        rollouts=1,
    )
    out = run_miles(
        "train", str(config), env={"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    )
    assert out.returncode != 0
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "its logprobs of the probe differ from the trainer's by" in log
    assert "does not serve the weights of version 1" in log
    assert children_of_run(run_dir) == []


def test_an_async_run_verifies_by_logprobs_once_the_engines_generate_again(
    tmp_path: Path, tiny_model: Path, arithmetic_prompts: Path
) -> None:
    """One-step-off with ``retract`` pauses: the probe is a generation, which a paused engine holds until
    ``/continue_generation``. Pushes verified inside the pause waited for themselves: the run hung at its first
    push (seen on real SGLang on a CPU with AMX, where ``auto`` picks logprobs). The push is paused, the
    verification follows it."""
    run_dir = tmp_path / "run"
    options = 'verify_with = "logprobs"\nrandomize_engines_first = true'
    config = write_run_config(
        tmp_path, tiny_model, arithmetic_prompts, run_dir, LOGPROBS, ranks=1, transport_options=options, rollouts=3
    )  # broadcast: pushed in line, inside the pause
    config.write_text(
        config.read_text().replace(
            "temperature = 1.0", 'temperature = 1.0\nmode = "one_step_off"\npause_mode = "retract"'
        )
    )
    out = run_miles("train", str(config), timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["weight_sync/verified"] == 1.0
        assert 0.0 <= row["weight_sync/verified_logprob_diff"] < 1e-3
    assert children_of_run(run_dir) == []
