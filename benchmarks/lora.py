"""LoRA against a full fine-tune on the ``fsdp`` trainer, in one run: peak RSS, step time, push bytes and seconds.

Each side runs in its own child process (one gloo rank, ``--threads`` threads) on the same random Llama
built from a config (``--hidden`` x ``--layers``): ``setup(need_ref=True)`` (a full fine-tune loads a
second, frozen copy of the weights as the KL reference; LoRA uses the base with its adapters off), one
warm-up step and ``--steps`` timed train steps (policy gradient on fixed random sequences), then
``--repeats`` pushes: ``iter_weights`` gathered and written as safetensors (what the ``disk`` and ``lora``
transports do before an engine loads the file). Peak RSS is the child's ``ru_maxrss``. Medians::

    python benchmarks/lora.py                 # hidden 768, 6 layers (~50M parameters)
    python benchmarks/lora.py --quick         # hidden 256, 2 layers

Prints a markdown table with LoRA / full ratios and writes ``benchmarks/results/lora.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_common_args, child_env, machine_info, markdown_table, median, versions, write_result


def _child(mode: str, model: str, steps: int, repeats: int, threads: int, port: int) -> dict[str, Any]:
    import random
    import resource

    import torch
    from common import pin_threads
    from safetensors.torch import save_file

    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles.testing.algorithms import RatioPG, RatioPGSettings
    from miles.training.batch import TrainBatch
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    pin_threads(threads)
    ctx = init_distributed(0, 1, master_port=port)
    trainer = FSDPTrainer(TrainSettings(model_path=model, lr=1e-4), FSDPSettings(), FP32(None), ctx)  # type: ignore[call-arg]
    if mode == "lora":
        from miles_lora.adapter import LoraAdapter
        from miles_lora.settings import LoraSettings

        trainer.adapter = LoraAdapter(LoraSettings(r=8, alpha=16))
    trainer.setup(need_ref=True)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    tokens = [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(8)]
    batch = TrainBatch.from_lists(
        tokens=tokens,
        prompt_lengths=[32] * 8,
        loss_mask=[[1] * 96] * 8,
        advantages=[[rng.gauss(0, 1) for _ in range(96)] for _ in range(8)],
        old_logprobs=[[-6.0] * 96] * 8,
        rollout_logprobs=[[-6.0] * 96] * 8,
    )
    algo = RatioPG(RatioPGSettings())
    trainer.train_step(batch, algo)  # warm-up
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.compute_logprobs(batch, model="ref")
        trainer.train_step(batch, algo)
        step_times.append(time.perf_counter() - start)
    push_times, push_bytes = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            start = time.perf_counter()
            tensors = {n: t.contiguous() for b in trainer.iter_weights(256 << 20) for n, t in b}
            save_file(tensors, f"{tmp}/push{i}.safetensors")
            push_times.append(time.perf_counter() - start)
            push_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    trainable = sum(p.numel() for p in trainer.actor.parameters() if p.requires_grad)
    trainer.close()
    shutdown_distributed()
    del torch
    return {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": median(step_times),
        "push_bytes": push_bytes,
        "push_s": median(push_times),
        "trainable_params": trainable,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29711, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.model, args.steps, args.repeats, args.threads, args.port)))
        return
    if args.quick:
        args.hidden, args.layers, args.steps, args.repeats = 256, 2, 2, 2
    from miles.testing.models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(
            Path(tmp) / "model",
            "llama",
            seed=0,
            vocab_size=512,
            hidden_size=args.hidden,
            intermediate_size=3 * args.hidden,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            num_kv_heads=max(args.hidden // 256, 1),
        )
        results: dict[str, dict[str, Any]] = {}
        for i, mode in enumerate(("full", "lora")):
            cmd = [sys.executable, __file__, "--child", mode, "--model", str(model), "--threads", str(args.threads)]
            cmd += ["--steps", str(args.steps), "--repeats", str(args.repeats), "--port", str(args.port + i)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=child_env(args.threads), check=True)
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    full, lora = results["full"], results["lora"]
    rows = []
    for key, label in (
        ("trainable_params", "trainable parameters"),
        ("peak_rss_mib", "trainer peak RSS (MiB)"),
        ("step_s", "step s (ref logprobs + train step)"),
        ("push_bytes", "push bytes"),
        ("push_s", "push s (gather + write)"),
    ):
        f, lo = full[key], lora[key]
        fmt = (
            (lambda v: f"{v:,.0f}")
            if key in ("trainable_params", "push_bytes", "peak_rss_mib")
            else (lambda v: f"{v:.3f}")
        )
        rows.append([label, fmt(f), fmt(lo), f"{lo / f:.3f}"])
    print(
        f"\nLoRA (r=8, all projections) vs full fine-tune, Llama hidden {args.hidden} x {args.layers} layers, "
        f"{args.threads} thread(s)\n"
    )
    print(markdown_table(["", "full", "LoRA", "LoRA / full"], rows))
    path = write_result(
        "lora",
        {
            "machine": machine_info(),
            "versions": versions(["torch", "peft"]),
            "hidden": args.hidden,
            "layers": args.layers,
            "results": results,
        },
        args.results_dir,
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
