"""Step time of ``miles train`` alone and beside one busy two-thread neighbour, before and after the
contention handling (``python benchmarks/contention.py [--quick]``; ``miles bench contention``).

"Before" is the thread setup ``miles train`` gave its children until the contention check: two torch threads
in every process (a 2-core machine, sync mode) and libgomp's default wait (spin 300,000 times at every
barrier, then sleep). "After" is what it gives now: the torch threads of the cores the other processes leave
free when the run starts (:func:`miles.launch.contention.check_start`) and ``OMP_WAIT_POLICY=PASSIVE``.

The neighbour is another two-thread job: a torch process multiplying 512 x 512 float32 matrices in a loop
with two OpenMP threads. Everything runs pinned to the same two cores (``taskset``), so a neighbour means
four busy threads for two cores: 2x oversubscription. The four cases run interleaved, ``--rounds`` times,
within one invocation (the machine's other load changes over minutes); each case's figure is the median
over rounds of the median step time after the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import REPO_ROOT, RESULTS_DIR, machine_info, markdown_table, median, versions, write_result

NEIGHBOUR = """
import torch
torch.set_num_threads(2)
a = torch.randn(512, 512)
while True:
    a = torch.tanh(a @ a) * 0.5
"""

POLICIES = {
    # what miles train set before the check: two threads per process, libgomp's default spin-then-sleep
    "before": {"OMP_NUM_THREADS": "2", "MILES_TORCH_THREADS": "2", "GOMP_SPINCOUNT": "300000"},
    # what it sets now (nothing forced from outside)
    "after": {},
}
_CLEARED = ("OMP_NUM_THREADS", "MILES_TORCH_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")


def _pin(cores: str) -> list[str]:
    return ["taskset", "-c", cores] if shutil.which("taskset") else []


def run_case(
    config: Path, policy: str, neighbour: bool, *, steps: int, cores: str, workdir: Path, extra: list[str]
) -> dict[str, Any]:
    """One ``miles train`` run; its step times and what it said about contention."""
    run_dir = workdir / f"{policy}-{'busy' if neighbour else 'alone'}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(POLICIES[policy])
    env["TOKENIZERS_PARALLELISM"] = "false"
    other = None
    if neighbour:
        clean = {**env, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
        other = subprocess.Popen([*_pin(cores), sys.executable, "-c", NEIGHBOUR], env=clean)
        time.sleep(3.0)  # busy before the run measures the machine
    argv = [
        *_pin(cores), sys.executable, "-m", "miles", "train", str(config),
        "--set", f"train.num_rollouts={steps}", "--set", "checkpoint.export_hf=false",
        "--set", f"log.run_dir={run_dir}", *extra,
    ]  # fmt: skip
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600, cwd=REPO_ROOT)
    finally:
        if other is not None:
            other.kill()
            other.wait()
    seconds = time.monotonic() - start
    if out.returncode != 0:
        raise SystemExit(f"{policy} {'busy' if neighbour else 'alone'}: miles train failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_seconds = [float(r["time/step_seconds"]) for r in rows]
    said = [line for line in out.stderr.splitlines() if "short of CPU" in line or "machine is busy" in line]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "policy": policy,
        "neighbour": neighbour,
        "step_seconds": step_seconds,
        "median_step_seconds": median(step_seconds[1:] or step_seconds),
        "run_seconds": round(seconds, 1),
        "load_before": load_before,
        "said": said,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "examples/quickstart/grpo_smollm2.toml")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is not counted)")
    parser.add_argument("--rounds", type=int, default=1, help="times each of the four cases runs, interleaved")
    parser.add_argument("--cores", default="0,1", help="the cores everything is pinned to (taskset -c)")
    parser.add_argument("--quick", action="store_true", help="the tiny random model, 3 steps")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()

    extra: list[str] = []
    workdir = Path(tempfile.mkdtemp(prefix="miles-contention-"))
    config, steps = args.config, args.steps
    if args.quick:
        from miles.testing.models import build_tiny_model

        model = build_tiny_model(workdir / "tiny", "qwen2", seed=0)
        config, steps = REPO_ROOT / "examples/tiny/grpo_tiny.toml", 3
        extra = ["--set", f"train.model_path={model}", "--set", "cluster.trainer_ranks=1"]
    cases: list[dict[str, Any]] = []
    try:
        for round_ in range(args.rounds):
            for policy in ("before", "after"):
                for neighbour in (False, True):
                    case = run_case(
                        config, policy, neighbour, steps=steps, cores=args.cores, workdir=workdir, extra=extra
                    )
                    case["round"] = round_
                    cases.append(case)
                    print(
                        f"round {round_ + 1}: {policy:6} {'with a neighbour' if neighbour else 'alone':16} "
                        f"{case['median_step_seconds']:7.2f} s/step  (steps {case['step_seconds']}, load "
                        f"{case['load_before']:.1f})",
                        flush=True,
                    )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def figure(policy: str, neighbour: bool) -> float:
        return median(
            [c["median_step_seconds"] for c in cases if c["policy"] == policy and c["neighbour"] == neighbour]
        )

    rows, summary = [], {}
    for policy in ("before", "after"):
        alone, busy = figure(policy, False), figure(policy, True)
        said = any(c["said"] for c in cases if c["policy"] == policy and c["neighbour"])
        summary[policy] = {"alone": alone, "neighbour": busy, "slowdown": busy / alone}
        rows.append([policy, f"{alone:.2f}", f"{busy:.2f}", f"{busy / alone:.1f}x", "yes" if said else "no"])
    machine = machine_info()
    table = markdown_table(
        ["threads and wait policy", "s/step alone", "s/step beside a 2-thread job", "slowdown", "the run said so"],
        rows,
    )
    print(f"\n{machine['cpu']}, {machine['cores']} cores (pinned to {args.cores}); {config.name}, {steps} steps")
    print(table)
    write_result(
        "contention" + ("_quick" if args.quick else ""),
        {
            "machine": machine,
            "versions": versions(),
            "config": str(config),
            "steps": steps,
            "cores": args.cores,
            "cases": cases,
            "summary": summary,
        },
        args.results_dir,
    )


if __name__ == "__main__":
    main()
