"""One training step of the megatron trainer in a given scenario, in its own processes (``--world``
gloo ranks). ``test_cpu_patches.py`` runs it with one CPU patch (or mbridge shim) switched off by
``MILES_MEGATRON_DISABLE_PATCHES`` and expects it to fail: each patch is still needed."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

SCENARIOS = {
    "dense": dict(world=1, arch="qwen2", options=dict(recompute="full")),
    "moe": dict(world=1, arch="qwen2_moe", options={}),
    "ep": dict(world=2, arch="qwen2_moe", options=dict(expert_parallel=2)),
    "sp": dict(world=2, arch="qwen2", options=dict(tensor_parallel=2, sequence_parallel=True)),
}


def _rank(rank: int, world: int, model: str, options: dict[str, object], port: int) -> None:
    import megatron_job as job
    import torch
    import torch.distributed as dist
    from miles_megatron.settings import MegatronSettings
    from miles_megatron.trainer import MegatronTrainer

    from miles.precision.builtin import FP32
    from miles.training.trainer import DistContext

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a probe without a patch may fail on one rank only: the other must not wait 30 minutes for it
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    trainer = MegatronTrainer(
        job._train_settings(model), MegatronSettings(**options), FP32(None), DistContext(rank, world)
    )  # type: ignore[arg-type]
    trainer.setup()
    batch = job.step_batches(job._vocab(model))[0].shard(rank, world)
    metrics = trainer.train_step(batch, job.PolicyGradient(), temperature=1.0)
    assert metrics["grad_norm"] > 0
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    scenario, models, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    spec = SCENARIOS[scenario]
    import torch.multiprocessing as mp

    world = int(spec["world"])  # type: ignore[call-overload]
    mp.spawn(_rank, args=(world, str(models / str(spec["arch"])), spec["options"], port), nprocs=world, join=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
