"""GPU check of routing replay (R3) in the fsdp trainer (passed on an H200, 2026-12-04: benchmarks/results/gpu_h200_2026-12-04/).

On one CUDA device: a local engine process serves the near-tied tiny Qwen3-MoE of
``miles-fsdp/tests/test_routing_replay.py`` in bfloat16 on CUDA, the rollout manager samples with routed
experts, and two fsdp trainers (1-rank NCCL, float32) recompute the logprobs with and without replay.
Prints routing agreement and max / mean |trainer - rollout| logprob both ways; exits non-zero unless replay
at least halves both. (True on-policy is CPU-only for now: ``check_true_on_policy`` refuses
``cluster.device = "cuda"``.)

    python scripts/gpu/fidelity_check.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

DEVICE = os.environ.get("MILES_GPU_CHECK_DEVICE", "cuda")
"""Where the checks run: ``cuda``; ``MILES_GPU_CHECK_DEVICE=cpu`` is a dry run of the script on the CPU."""

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    sys.path.insert(0, str(ROOT / "miles-fsdp" / "tests"))
    import test_routing_replay as r3

    from miles.testing.algorithms import RatioPG
    from miles.testing.engine import EngineProcess
    from miles.training.batch import TrainBatch
    from miles_fsdp.distributed import init_distributed, shutdown_distributed

    with tempfile.TemporaryDirectory() as tmp:
        model = r3.build_near_tied_moe(Path(tmp))
        args = ["--dtype", "bfloat16", "--device", DEVICE]
        with EngineProcess(model, extra_args=args, log_path=Path(tmp) / "engine.log") as engine:
            samples = r3.rollout(engine.url)
        batch = TrainBatch.from_samples(samples)
        ctx = init_distributed(0, 1, device=DEVICE, local_rank=0, master_port=r3.free_port())
        try:
            results = {}
            for replay in (False, True):
                trainer = r3.new_trainer(model, ctx, replay=replay)
                diff = r3.differences(trainer, batch)
                step = trainer.train_step(r3.with_advantages(samples), RatioPG(), temperature=1.0)
                trainer.close()
                results[replay] = (float(diff.max()), float(diff.mean()), step["fidelity/routing_agreement"])
                print(
                    f"replay={replay}: max {results[replay][0]:.4g} mean {results[replay][1]:.4g} "
                    f"agreement {results[replay][2]:.3f}"
                )
        finally:
            shutdown_distributed()
    off, on = results[False], results[True]
    if not (on[0] < 0.5 * off[0] and on[1] < 0.5 * off[1] and off[2] < 1.0):
        raise SystemExit("FAIL: replay did not halve the logprob difference on CUDA")
    print("OK")


if __name__ == "__main__":
    main()
