"""GPU check of miles-diffusion (passed on an H200, 2026-12-04: benchmarks/results/gpu_h200_2026-12-04/).

On one CUDA device: build the tiny policy, sample on CUDA with the engine's loop and check the trainer's
re-scoring of the recorded steps (bf16 transformer and float32), then one Flow-GRPO train step of the
diffusion trainer on a 1-rank NCCL world. Prints one line per check; exits non-zero on the first failure.

    python scripts/gpu/diffusion_check.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

DEVICE = os.environ.get("MILES_GPU_CHECK_DEVICE", "cuda")
"""Where the checks run: ``cuda``; ``MILES_GPU_CHECK_DEVICE=cpu`` is a dry run of the script on the CPU."""


def main() -> None:
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "miles-diffusion" / "tests"))
    from trainer_job import make_batch

    from miles.precision.builtin import BF16, FP32
    from miles.settings.model import TrainSettings
    from miles_diffusion.algorithm import FlowGRPO, FlowGRPOSettings
    from miles_diffusion.policy import build_tiny_policy, load_pipeline
    from miles_diffusion.sampling import SamplingOptions, sample_trajectories
    from miles_diffusion.trainer.trainer import DiffusionTrainer, DiffusionTrainerSettings
    from miles_fsdp.distributed import init_distributed, shutdown_distributed

    with tempfile.TemporaryDirectory() as tmp:
        policy = build_tiny_policy(Path(tmp) / "policy")
        for dtype in ("float32", "bfloat16"):
            pipe = load_pipeline(policy, device=DEVICE, dtype=dtype)
            trajs = sample_trajectories(
                pipe, ["a red square"] * 4, [1, 2, 3, 4], SamplingOptions(num_steps=6, max_sequence_length=16)
            )
            assert all(len(t.logprobs) == 6 for t in trajs)
            print(f"ok: sampling on cuda in {dtype}")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist = init_distributed(0, 1, device=DEVICE, master_port=29533)
        batch, rollout = make_batch(str(policy))
        for recipe in (FP32(FP32.Settings()), BF16(BF16.Settings())):
            trainer = DiffusionTrainer(
                TrainSettings(model_path=str(policy), lr=1e-3), DiffusionTrainerSettings(), recipe, dist
            )
            trainer.setup()
            scored = trainer.compute_logprobs(batch).logprobs
            gap = float((scored - torch.tensor(rollout)).abs().max())
            print(
                f"{recipe.name}: max |trainer - sampler| log-prob gap {gap:.2e} (the sampler ran in float32 on the CPU)"
            )
            batch.set_token_field("old_logprobs", list(scored.split(batch.response_lengths)))
            metrics = trainer.train_step(batch, FlowGRPO(FlowGRPOSettings(kl_coef=0.1)))
            assert metrics["grad_norm"] > 0
            print(f"ok: {recipe.name} train step on cuda, loss {metrics['loss']:.3e}")
            trainer.close()
        shutdown_distributed()


if __name__ == "__main__":
    main()
