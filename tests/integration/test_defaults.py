"""Defaults chosen from the machine, end to end: with ``precision = "auto"`` and ``transport = "auto"``,
``miles train --dry-run`` and a real run print the chosen precision, transport and thread split with their
reasons, and the run trains with them (bf16 where this CPU has bf16 units whose bf16 GEMMs are fast, float32
with the engine serving bfloat16 where they are slow, float32 elsewhere; p2p written into the engine's weights:
miles-p2p is installed here and the local engine runs on this host)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from miles.defaults import MachineFacts, choose_engine_dtype, choose_precision, split_threads, usable_cores
from miles.testing.runs import read_metrics, run_miles, write_run_config

P2P_REASON = (
    "transport: p2p (auto: every engine is a local engine on the trainer's host, so the trainer writes straight "
    "into their weights in shared memory (p2p, datapath shm, write_into_weights))"
)


def _said(stdout: str) -> dict[str, str]:
    """The lines of ``miles train``'s summary by their first word (``precision``, ``transport``, ``threads``)."""
    return {line.partition(":")[0]: line for line in stdout.splitlines() if line.partition(":")[2]}


def test_dry_run_and_run_print_each_choice_and_the_run_trains_with_them(
    tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    run_dir = tmp_path / "run"
    # no [precision] table: the default, "auto"
    config = write_run_config(tmp_path, tiny_model, prompts, run_dir, transport="auto", rollouts=2, precision=None)
    # what this host's facts give; its bf16 GEMMs are measured in each process, so the reasons' figures differ
    facts = MachineFacts.of_this_host(measure_gemms=True)
    precision = choose_precision(device="cpu", cpu_flags=facts.cpu_flags, bf16_gemm_speedup=facts.bf16_gemm_speedup)
    engine_dtype = choose_engine_dtype(
        device="cpu", cpu_flags=facts.cpu_flags, precision=precision.value, bf16_gemm_speedup=facts.bf16_gemm_speedup
    )
    said_precision = f"precision: {precision.value} ({precision.reason.partition(' run at ')[0]}"
    expected_threads = split_threads(
        mode="sync",
        cores=usable_cores(),
        trainer_ranks=2,
        num_engines=1,
        environ={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    dry = run_miles("train", "--dry-run", str(config), env={"COLUMNS": "300"})
    assert dry.returncode == 0, dry.stdout + dry.stderr
    said = _said(dry.stdout)
    assert said["precision"].startswith(said_precision)
    assert said["transport"] == P2P_REASON
    assert said["threads"] == expected_threads.line()
    if engine_dtype is not None:
        assert said["rollout.engine_dtype"] == f"rollout.engine_dtype: bfloat16 ({engine_dtype.reason})"
    assert not run_dir.exists()

    real = run_miles("train", str(config), env={"COLUMNS": "300", "MILES_TORCH_THREADS": "1"})
    assert real.returncode == 0, real.stdout[-3000:] + real.stderr[-3000:]
    said = _said(real.stdout)
    assert said["precision"].startswith(said_precision)
    assert said["transport"] == P2P_REASON
    assert said["threads"] == (
        "threads: 1 per trainer rank, 1 per engine: MILES_TORCH_THREADS=1 set in the environment; "
        "OpenMP threads wait passively (the pools' size is set from outside)"
    )
    settings = json.loads((run_dir / "settings.json").read_text())
    assert settings["precision"]["name"] == precision.value
    assert settings["rollout"]["engine_dtype"] == ("auto" if engine_dtype is None else "bfloat16")
    assert settings["transport"]["name"] == "p2p"
    assert (settings["transport"]["datapath"], settings["transport"]["write_into_weights"]) == ("shm", True)
    steps = [m for m in read_metrics(run_dir) if "weight_sync/verified" in m]
    assert len(steps) == 2 and all(m["weight_sync/verified"] == 1.0 for m in steps)
