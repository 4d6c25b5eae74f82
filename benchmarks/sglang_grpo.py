"""The quickstart's GRPO run (``examples/quickstart/grpo_smollm2.toml``: SmolLM2-135M-Instruct, two-digit
arithmetic) with real SGLang as the rollout engine against Miles' local engine, same seeds, one after the other.

Both runs are ``miles train`` on the quickstart's config with the same overrides: ``--steps`` rollouts, the
engine serving bfloat16 (SGLang's CPU kernels have no float32; the local engine is given the same dtype), the
same ``train.seed`` and data order. They differ only in ``rollout.engine`` (``local`` or ``sglang`` with
``cluster.device = "cpu"``). SGLang ignores ``sampling_seed`` on a CPU (``docs/how-to/sglang-cpu.md``), so the
two runs sample different responses from the same prompts; the local engine's are seeded.

Prints the reward curve and the seconds per step side by side (step 1, which includes warm-ups, is left out of
the medians), and the engines' start-up (launch to the first step). Run it with the python of the SGLang CPU
environment::

    $(python scripts/sglang/cpu_env.py) -m benchmarks.sglang_grpo             # 10 steps each
    $(python scripts/sglang/cpu_env.py) -m benchmarks.sglang_grpo --quick     # 3 steps each

Writes ``benchmarks/results/sglang_grpo.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import add_common_args, machine_info, markdown_table, versions, write_result

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "quickstart" / "grpo_smollm2.toml"

ENGINES: dict[str, list[str]] = {
    "local": ["rollout.engine.name=local"],
    "sglang": [
        "rollout.engine.name=sglang",
        "rollout.engine.max_total_tokens=8192",
        "rollout.engine.log_level=warning",
    ],
}


def run(engine: str, steps: int, workdir: Path, timeout: float) -> dict[str, Any]:
    """One ``miles train`` of the quickstart with ``engine``; its metrics per step and its wall time."""
    run_dir = workdir / engine
    overrides = [
        f"train.num_rollouts={steps}",
        f"log.run_dir={json.dumps(str(run_dir))}",
        f"data.path={json.dumps(str(ROOT / 'examples' / 'quickstart' / 'train.jsonl'))}",
        "cluster.device=cpu",
        "rollout.engine_dtype=bfloat16",
        *ENGINES[engine],
    ]
    argv = [sys.executable, "-m", "miles", "train", str(CONFIG)]
    for item in overrides:
        argv += ["--set", item]
    start = time.perf_counter()
    with (workdir / f"{engine}.log").open("wb") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (workdir / f"{engine}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"miles train with rollout.engine = {engine!r} failed ({proc.returncode}):\n{tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "wall_seconds": wall,
        "reward_mean": [r["rollout/reward_mean"] for r in rows],
        "step_seconds": [r["time/step_seconds"] for r in rows],
        "verified": [r.get("weight_sync/verified") for r in rows],
        "verification": "logprobs" if any("weight_sync/verified_logprob_diff" in r for r in rows) else "rows",
        "startup_seconds": wall - sum(r["time/step_seconds"] for r in rows),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--steps", type=int, default=10, help="rollouts (training steps) of each run")
    parser.add_argument("--timeout", type=float, default=5400.0, help="seconds one run may take")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 3
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="miles-bench-sglang-grpo-") as tmp:
        for engine in ENGINES:
            results[engine] = run(engine, args.steps, Path(tmp), args.timeout)
    local, sglang = results["local"], results["sglang"]
    rows = [
        (
            step + 1,
            f"{local['reward_mean'][step]:.3f}",
            f"{sglang['reward_mean'][step]:.3f}",
            f"{local['step_seconds'][step]:.1f}",
            f"{sglang['step_seconds'][step]:.1f}",
        )
        for step in range(args.steps)
    ]
    later = slice(1, None) if args.steps > 1 else slice(None)
    summary = {
        engine: {
            "median_step_seconds": statistics.median(r["step_seconds"][later]),
            "mean_reward_first_half": statistics.mean(r["reward_mean"][: max(1, args.steps // 2)]),
            "mean_reward_second_half": statistics.mean(r["reward_mean"][args.steps // 2 :]),
        }
        for engine, r in results.items()
    }
    print(
        f"## GRPO on SmolLM2 (the quickstart): SGLang rollout against the local engine\n\n{args.steps} steps each, "
        f"4 prompts x 8 samples x up to 16 tokens a step, engines in bfloat16, same seeds, "
        f"{machine_info('cpu')['cpu']}\n"
    )
    print(
        markdown_table(
            ["step", "reward, local engine", "reward, SGLang", "s/step, local engine", "s/step, SGLang"], rows
        )
    )
    print()
    print(
        markdown_table(
            [
                "engine",
                "median s/step (steps 2+)",
                "s/step / local engine's",
                "mean reward, first half",
                "mean reward, second half",
                "start-up s",
            ],
            [
                (
                    engine,
                    f"{s['median_step_seconds']:.1f}",
                    f"{s['median_step_seconds'] / summary['local']['median_step_seconds']:.2f}x",
                    f"{s['mean_reward_first_half']:.3f}",
                    f"{s['mean_reward_second_half']:.3f}",
                    f"{results[engine]['startup_seconds']:.0f}",
                )
                for engine, s in summary.items()
            ],
        )
    )
    payload = {
        "machine": machine_info("cpu"),
        "versions": versions(("sglang", "sglang-kernel-cpu")),
        "load_average": list(_load_average()),
        "config": {k: v for k, v in vars(args).items() if k != "results_dir"},
        "results": results,
        "summary": summary,
    }
    write_result("sglang_grpo", payload, args.results_dir)
    return payload


def _load_average() -> tuple[float, float, float]:
    import os

    return os.getloadavg()


if __name__ == "__main__":
    main()
