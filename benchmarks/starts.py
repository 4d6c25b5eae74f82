"""Start-up reliability: many tiny ``miles train`` runs back to back, each one counted as started or not (issue 45).

Every run launches one engine, a router (``--router``) and two trainer ranks, takes one GRPO step and exits.
A run *started* when its first step was logged; one that did not is classified by what its logs say (a port
taken before a service bound it, anything else). Ports a run had to choose again (the launcher says so in a
warning) are counted too: they are races that happened and were survived::

    python -m benchmarks.starts                # 50 runs (about 25 minutes on 2 cores)
    python -m benchmarks.starts --runs 5       # a shorter check
    python -m benchmarks.starts --quick        # 3 runs

Not a CI test: the figure goes to docs/reliability.md with the machine it came from.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, add_common_args, child_env, machine_info, markdown_table, write_result

PORT_FAILURE = ("address already in use", "errno 98", "eaddrinuse")
MOVED = "was taken before"


def _classify(run_dir: Path, out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """Started or not, why not, and how many ports were chosen again."""
    logs = out.stdout + out.stderr
    for log in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []:
        logs += log.read_text(errors="replace")
    metrics = run_dir / "metrics.jsonl"
    started = metrics.exists() and bool(metrics.read_text().strip())
    lowered = logs.lower()
    cause = None
    if not started:
        cause = "port" if any(marker in lowered for marker in PORT_FAILURE) else "other"
    return {
        "started": started,
        "returncode": out.returncode,
        "cause": cause,
        "rebinds": logs.count(MOVED),
        "tail": None if started else logs[-1500:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--runs", type=int, default=50, help="runs back to back (default 50)")
    parser.add_argument("--router", action="store_true", help="put smg in front of the engine (needs smg installed)")
    args = parser.parse_args(argv)
    runs = 3 if args.quick else args.runs

    from miles.testing.models import build_tiny_model
    from miles.testing.runs import write_arithmetic_prompts, write_run_config

    workdir = Path(tempfile.mkdtemp(prefix="miles-starts-"))
    model = build_tiny_model(workdir / "model", "qwen2", seed=0)
    prompts = write_arithmetic_prompts(workdir / "prompts.jsonl")
    extra = '[rollout.router]\nname = "smg"\n' if args.router else ""
    env = child_env(args.threads)
    rows: list[dict[str, Any]] = []
    for i in range(runs):
        run_dir = workdir / f"run{i}"
        config_dir = workdir / f"config{i}"
        config_dir.mkdir()
        config = write_run_config(config_dir, model, prompts, run_dir, extra, ranks=2, rollouts=1)
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "miles", "train", str(config)],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO_ROOT,
            timeout=900,
        )
        row = {"run": i, "seconds": time.perf_counter() - start, **_classify(run_dir, out)}
        rows.append(row)
        status = "started" if row["started"] else f"FAILED ({row['cause']})"
        print(
            f"run {i + 1}/{runs}: {status}, {row['rebinds']} port(s) chosen again, {row['seconds']:.1f} s", flush=True
        )

    started = sum(r["started"] for r in rows)
    port_failures = sum(r["cause"] == "port" for r in rows)
    table = markdown_table(
        ["runs", "started", "failed: port taken", "failed: other", "ports chosen again (survived)"],
        [[runs, started, port_failures, runs - started - port_failures, sum(r["rebinds"] for r in rows)]],
    )
    print(table)
    payload = {"machine": machine_info(), "router": args.router, "runs": rows, "table": table}
    print(f"result: {write_result('starts', payload, args.results_dir)}")
    failed = [r for r in rows if not r["started"]]
    for row in failed:
        print(f"--- run {row['run']} ({row['cause']}):\n{row['tail']}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
