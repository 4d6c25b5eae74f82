"""Step-time cost of the fidelity mechanisms against the default, in one run: routing replay (R3) on a tiny
Qwen3-MoE and true on-policy on a tiny dense Qwen2, each against the same fsdp trainer with the mode off.

One gloo rank in this process, threads pinned; for each model the trainers are set up once and time
``train_step`` (forward + backward + AdamW, the kit's ``RatioPG`` loss) on one fixed batch, median of the
timed steps after a warm-up step; rounds alternate the order of the two sides. The batch's routed experts
are the model's own routing (recorded from a forward of the same weights, as the engine would report
them), so replay sends the tokens through the experts the default run uses; its rollout logprobs are zeros
(true on-policy's cost is its replica's prefill + one decode step per response token, whatever the values)::

    python -m benchmarks.fidelity            # 8 sequences of 32 + 32 tokens, 3 rounds x 3 steps
    python -m benchmarks.fidelity --quick

Prints a markdown table and writes ``benchmarks/results/fidelity.json``.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    pin_threads(args.threads)
    from miles.testing.models import build_tiny_model
    from miles_fsdp.distributed import init_distributed, shutdown_distributed

    sequences, prompt, response = (4, 16, 8) if args.quick else (8, 32, 32)
    rounds, steps = (1, 1) if args.quick else (args.rounds, args.steps)
    cases = {
        "routing_replay (qwen3_moe)": ("qwen3_moe", "routing_replay"),
        "true_on_policy (qwen2)": ("qwen2", "true_on_policy"),
    }
    rows = []
    results: dict[str, Any] = {}
    ctx = init_distributed(0, 1, master_port=free_port())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for label, (arch, switch) in cases.items():
                model = build_tiny_model(Path(tmp) / arch, arch, seed=0, num_experts=8)  # type: ignore[arg-type]
                moe = arch.endswith("moe")
                batch = _batch(sequences, prompt, response, model if moe else None)
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
    table = markdown_table(["mode (model)", "default ms/step", "mode ms/step", "cost"], rows)
    print(f"{sequences} sequences x ({prompt} prompt + {response} response) tokens, {args.threads} thread(s)\n")
    print(table)
    write_result(
        "fidelity",
        {"table": table, "results": results, "machine": machine_info(), "shape": [sequences, prompt, response]},
        args.results_dir,
    )


if __name__ == "__main__":
    main()
