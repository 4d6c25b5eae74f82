"""The fsdp trainer's GRPO step at world size 1 in its configurations, side by side in one process.

Each round builds the trainer of every configuration in turn (one at a time: one SmolLM2 trainer holds
~2.2 GB), runs ``--warmup`` untimed and ``--steps`` timed ``train_step`` calls (forward + backward + AdamW
of the kit's ``RatioPG`` loss on a fixed batch of ``--seqs`` sequences of ``--prompt-len`` + ``--response-len``
tokens, lr 1e-5) and records their wall times and losses; rounds rotate the order. The table shows the median
step time, its ratio to the first configuration, and the largest difference of the losses of consecutive
steps (the loss curve from the same start on the same batch) from the first configuration's; ``--profile``
adds a ``torch.profiler`` table of one step per configuration::

    python -m benchmarks.trainer_step --threads 2
    python -m benchmarks.trainer_step --configs fsdp-fp32,plain-fp32-fused,plain-bf16-fused

Configurations: ``fsdp-*`` wraps with FSDP2 at world size 1 (``wrap_single_rank``; bf16 through FSDP's
``MixedPrecisionPolicy``), ``plain-*`` keeps the module (bf16 through ``torch.autocast``), ``-fused`` scores
through the chunked fused LM head (``fused_logprobs``), ``-onednn`` runs every linear's GEMMs on oneDNN
(``onednn_linear``; the others run ``F.linear``), ``-packed`` attends sequence by sequence
(``attn_implementation = "packed_sdpa"``; the others: ``sdpa`` over a block-diagonal mask).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_common_args,
    machine_info,
    markdown_table,
    median,
    model_dir,
    pin_threads,
    versions,
    write_result,
)

log = logging.getLogger("benchmarks.trainer_step")


def _config(
    precision: str, *, wrap: bool = False, fused: bool = False, onednn: bool = False, packed: bool = False
) -> dict[str, Any]:
    return {
        "precision": precision,
        "wrap_single_rank": wrap,
        "fused_logprobs": fused,
        "onednn_linear": onednn,
        "attn_implementation": "packed_sdpa" if packed else "sdpa",
    }


CONFIGS: dict[str, dict[str, Any]] = {
    "fsdp-fp32": _config("fp32", wrap=True),
    "plain-fp32": _config("fp32"),
    "plain-fp32-fused": _config("fp32", fused=True),
    "plain-fp32-onednn": _config("fp32", onednn=True),
    "plain-fp32-onednn-packed": _config("fp32", onednn=True, packed=True),
    "fsdp-bf16": _config("bf16", wrap=True),
    "plain-bf16": _config("bf16"),
    "plain-bf16-fused": _config("bf16", fused=True),
    "plain-bf16-onednn": _config("bf16", onednn=True),
    "plain-bf16-onednn-packed": _config("bf16", onednn=True, packed=True),
    "plain-bf16-onednn-packed-fused": _config("bf16", fused=True, onednn=True, packed=True),
}
"""``-packed``: ``packed_sdpa`` attention, with shared prompts when ``--group-size`` > 1 (the trainer's defaults
are ``plain-*-onednn-packed``)."""


def _batch(vocab: int, args: argparse.Namespace) -> Any:
    from miles.training.batch import TrainBatch

    rng = random.Random(0)
    n, response = args.seqs, args.response_len
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(0, n, args.group_size)]
    return TrainBatch.from_lists(
        tokens=[prompts[i // args.group_size] + [rng.randrange(vocab) for _ in range(response)] for i in range(n)],
        prompt_lengths=[args.prompt_len] * n,
        loss_mask=[[1] * response for _ in range(n)],
        advantages=[[rng.gauss(0.0, 1.0) for _ in range(response)] for _ in range(n)],
        old_logprobs=[[-8.0] * response for _ in range(n)],
    )


def _run_config(name: str, model: Path, args: argparse.Namespace, ctx: Any) -> dict[str, list[float]]:
    from miles.precision.builtin import BF16, FP32
    from miles.settings.model import TrainSettings
    from miles.testing.algorithms import RatioPG
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    spec = dict(CONFIGS[name])
    precision = BF16(None) if spec.pop("precision") == "bf16" else FP32(None)
    train = TrainSettings(  # type: ignore[call-arg]
        model_path=str(model), lr=1e-5, max_tokens_per_micro_batch=args.micro_batch_tokens, num_rollouts=100
    )
    trainer = FSDPTrainer(train, FSDPSettings(**spec), precision, ctx)  # type: ignore[arg-type]
    trainer.setup()
    batch = _batch(int(json.loads((model / "config.json").read_text())["vocab_size"]), args)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        metrics = trainer.train_step(batch, RatioPG())
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(metrics["loss"])
    if args.profile:  # one more step under torch.profiler: where the step's CPU time goes
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step(batch, RatioPG())
        log.info("%s profile:\n%s", name, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    trainer.close()
    return {"times": times, "losses": losses}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--model", default="smollm2", help="smollm2 or tiny")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=1, help="sequences sharing each prompt (a GRPO group)")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of one more step")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown} (expected from {list(CONFIGS)})")
    if args.quick:
        args.model, args.rounds, args.steps = "tiny", 1, 1
    pin_threads(args.threads)
    from miles.net import free_port
    from miles_fsdp.distributed import init_distributed, shutdown_distributed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    ctx = init_distributed(0, 1, master_port=free_port())
    model = model_dir(args.model, Path(tempfile.gettempdir()) / "miles-bench-models")
    runs: dict[str, list[dict[str, list[float]]]] = {n: [] for n in names}
    try:
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(_run_config(name, model, args, ctx))
                log.info("round %d %s: %s", r, name, runs[name][-1])
    finally:
        shutdown_distributed()
    base = names[0]
    base_s = median([t for run in runs[base] for t in run["times"]])
    base_losses = runs[base][0]["losses"]
    rows, records = [], {}
    tokens = args.seqs * (args.prompt_len + args.response_len)
    for name in names:
        step_s = median([t for run in runs[name] for t in run["times"]])
        diff = max(abs(a - b) for a, b in zip(runs[name][0]["losses"], base_losses, strict=True))
        records[name] = {"step_s": step_s, "runs": runs[name], "max_loss_diff_vs_base": diff}
        rows.append([name, f"{step_s:.2f}", f"{tokens / step_s:.0f}", f"{base_s / step_s:.2f}x", f"{diff:.2e}"])
    headers = ["config", "step s", "tokens/s", f"speed vs {base}", f"max |loss - {base} loss|"]
    log.info("%s", markdown_table(headers, rows))
    write_result(
        "trainer_step",
        {
            "machine": machine_info(),
            "versions": versions(["torch", "transformers"]),
            "args": vars(args) | {"results_dir": None},
            "configs": records,
        },
        args.results_dir,
    )


if __name__ == "__main__":
    main()
