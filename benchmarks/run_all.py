"""Run the benchmark suite one benchmark at a time, print every table, keep the results.

Each benchmark runs as its own subprocess (``python benchmarks/<name>.py``) so that no two measure at
once and none inherits another's threads or memory. ``benchmarks/results/<name>.json`` holds each
benchmark's own record; ``benchmarks/results/<name>.md`` its printed tables (for scripts that write no
JSON of their own, ``<name>.json`` holds the printed output); ``benchmarks/results/run_all.json`` the
run's summary::

    python -m benchmarks.run_all                      # the full suite (about 20 minutes on 2 cores)
    python -m benchmarks.run_all --quick              # reduced sizes (a few minutes)
    python -m benchmarks.run_all --only weight_sync,scaling
    python -m benchmarks.run_all --device cuda        # on a GPU

Exits non-zero when a benchmark failed (the others still run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BENCH_DIR, DEFAULT_THREADS, RESULTS_DIR, child_env, machine_info, write_result

SUITE: dict[str, dict[str, list[str]]] = {
    "grpo_vs_trl": {"full": ["--rounds", "2", "--steps", "3"], "quick": ["--quick"]},
    "grpo_same_batch": {"full": [], "quick": ["--model", "tiny", "--quick"]},
    "engine": {"full": [], "quick": ["--models", "tiny", "--batches", "1,8", "--repeats", "2"]},
    "engine_http": {"full": [], "quick": ["--quick"]},
    "weight_sync": {"full": [], "quick": ["--quick"]},
    "weight_sync_multinode": {"full": [], "quick": ["--quick"]},  # (root: namespace hosts; else skipped)
    "disk_delta": {"full": [], "quick": ["--quick"]},
    "scaling": {"full": [], "quick": ["--quick"]},
    "router": {"full": [], "quick": ["--quick"]},
    "sessions": {"full": [], "quick": ["--quick"]},
    "sampling_mask": {"full": [], "quick": ["--model", "tiny", "--quick"]},
    "vlm": {"full": [], "quick": ["--quick"]},
    "async": {
        "full": [
            "--model",
            "smollm2",
            "--prompts",
            "1",
            "--samples",
            "2",
            "--tokens",
            "64",
            "--steps",
            "10",
            "--max-staleness",
            "1,2",
        ],
        "quick": ["--model", "tiny", "--steps", "4"],
    },
}
"""Benchmarks in run order, with the arguments of a full and a ``--quick`` run."""

OWN_JSON = {
    "grpo_vs_trl",
    "grpo_same_batch",
    "engine_http",
    "weight_sync",
    "weight_sync_multinode",
    "disk_delta",
    "scaling",
    "router",
    "sessions",
    "sampling_mask",
    "vlm",
}
"""Benchmarks that take ``--device`` / ``--threads`` / ``--results-dir`` and write their own JSON."""


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = list(SUITE[name]["quick" if args.quick else "full"])
    if name in OWN_JSON:
        argv += ["--threads", str(args.threads), "--device", args.device, "--results-dir", str(args.results_dir)]
    elif name != "async":  # async pins one thread per process: an engine and a trainer share the cores
        argv += ["--threads", str(args.threads)]
    command = [sys.executable, "-m", f"benchmarks.{name}", *argv]
    print(f"\n$ {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(
        command, env=child_env(args.threads), capture_output=True, text=True, check=False, cwd=BENCH_DIR.parent
    )
    seconds = time.perf_counter() - start
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{name}.md").write_text(proc.stdout)
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        print(f"{name} FAILED (exit {proc.returncode}):\n{proc.stderr[-4000:]}", flush=True)
    if name not in OWN_JSON:
        write_result(
            name,
            {
                "machine": machine_info(args.device),
                "command": command[1:],
                "returncode": proc.returncode,
                "stdout": proc.stdout,
            },
            args.results_dir,
        )
    return {
        "returncode": proc.returncode,
        "seconds": round(seconds, 1),
        "stderr_tail": proc.stderr[-2000:] if proc.returncode else "",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="reduced sizes")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(SUITE)}")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="threads per process (pinned)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(SUITE)
    for name in names:
        if name not in SUITE:
            parser.error(f"--only: unknown benchmark {name!r} (expected {', '.join(SUITE)})")
    if args.device == "cuda" and "engine" in names:
        print("engine: benchmarks/engine.py runs on the CPU only; measuring it there", flush=True)

    summary: dict[str, Any] = {}
    start = time.perf_counter()
    for name in names:
        summary[name] = run_one(name, args)
    total = time.perf_counter() - start
    failed = [n for n, r in summary.items() if r["returncode"] != 0]
    write_result(
        "run_all",
        {"quick": args.quick, "seconds": round(total, 1), "machine": machine_info(args.device), "benchmarks": summary},
        args.results_dir,
    )
    print(
        f"\nsuite: {len(names) - len(failed)}/{len(names)} benchmarks ok in {total / 60:.1f} min; results in {args.results_dir}"
    )
    if failed:
        print(f"failed: {', '.join(failed)}")
    print(json.dumps({n: r["seconds"] for n, r in summary.items()}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
