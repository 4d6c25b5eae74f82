"""The diffusion trainer (FSDP2 over the diffusers transformer) on real gloo worlds of 1 and 2 CPU ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from miles.net import free_port

JOB = Path(__file__).resolve().parent.parent / "trainer_job.py"


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def job(request: pytest.FixtureRequest, policy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp(f"world{request.param}")
    argv = [
        sys.executable,
        str(JOB),
        "--world-size",
        str(request.param),
        "--policy",
        str(policy_dir),
        "--out",
        str(out),
    ]
    subprocess.run([*argv, "--port", str(free_port())], check=True, timeout=600)
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    results["out"] = out
    results["world_size"] = request.param
    return results


@pytest.mark.slow
def test_the_trainer_rescores_the_samplers_steps(job: dict[str, Any]) -> None:
    assert job["logprob_max_diff"] < 1e-4


@pytest.mark.slow
def test_a_step_trains_with_the_kl_and_reports_its_metrics(job: dict[str, Any]) -> None:
    first, second = job["first"], job["second"]
    assert first["trained_pairs"] == 16.0 and first["trajectories"] == 4.0
    assert first["kl"] == 0.0 and second["kl"] > 0.0  # the first step starts at the reference
    assert first["ratio"] == pytest.approx(1.0, abs=1e-5) and first["grad_norm"] > 0.0
    assert first["train_rollout_logprob_abs_diff"] < 1e-4


@pytest.mark.slow
def test_resume_is_bit_identical(job: dict[str, Any]) -> None:
    assert job["same_weights_after_resume"] and job["resumed"] == job["second"]


@pytest.mark.slow
def test_the_export_is_a_pipeline_with_the_trained_transformer(job: dict[str, Any], policy_dir: Path) -> None:
    from miles_diffusion.policy import load_transformer

    exported, initial = load_transformer(job["out"] / "exported"), load_transformer(policy_dir)
    from miles_diffusion.policy import load_pipeline

    assert load_pipeline(job["out"] / "exported").vae is not None  # every other component is the policy's
    trained = float(sum(p.detach().double().sum() for p in exported.parameters()))
    assert trained == pytest.approx(job["weight_sum"], rel=1e-9)
    assert trained != float(sum(p.detach().double().sum() for p in initial.parameters()))
