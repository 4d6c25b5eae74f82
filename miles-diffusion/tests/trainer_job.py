"""A real job for the trainer tests: the diffusion trainer on ``--world-size`` gloo ranks (spawned with
``torch.multiprocessing``). Every rank builds the same batch of trajectories (sampled here with the
pipeline), then: re-scores it (against the sampler's log-probs), trains two steps, saves after the first,
resumes a fresh trainer from that checkpoint and trains the second again, and exports the pipeline.
Rank 0 writes ``results.json``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.multiprocessing as mp

from miles.algorithms.base import AdvantageInputs
from miles.precision.builtin import FP32
from miles.settings.model import TrainSettings
from miles.training.batch import TrainBatch
from miles.transport.verify import tensor_checksum
from miles.types import Sample, SampleGroup
from miles_diffusion.algorithm import FlowGRPO, FlowGRPOSettings
from miles_diffusion.trainer.trainer import DiffusionTrainer, DiffusionTrainerSettings
from miles_diffusion.wire import tensor_data


def make_batch(policy: str) -> tuple[TrainBatch, list[float]]:
    """Two groups of two trajectories (4 SDE steps of 5), scored by mean brightness; advantages set."""
    from miles_diffusion.policy import load_pipeline
    from miles_diffusion.sampling import SamplingOptions, sample_trajectories

    pipe = load_pipeline(policy)
    texts = ["a red square", "a red square", "a dark sky", "a dark sky"]
    options = SamplingOptions(num_steps=5, guidance_scale=1.0, sde_window=(0, 4), max_sequence_length=16)
    samples = []
    for i, (text, traj) in enumerate(zip(texts, sample_trajectories(pipe, texts, [1, 2, 3, 4], options), strict=True)):
        samples.append(
            Sample(
                list(pipe.tokenizer(text)["input_ids"]),
                list(traj.steps),
                list(traj.logprobs),
                [1] * len(traj.steps),
                reward=float(traj.image.mean()) / 255.0,
                group_id=i // 2,
                index=i % 2,
                response_tensors={n: tensor_data(t) for n, t in traj.tensors().items()},
            )
        )
    groups = [SampleGroup(0, samples[:2]), SampleGroup(1, samples[2:])]
    algo = FlowGRPO(FlowGRPOSettings(kl_coef=0.1, clip_eps=0.2))
    adv = algo.compute_advantages(AdvantageInputs(groups))
    batch = TrainBatch.from_samples(samples, advantages=[a.tolist() for g in adv.advantages for a in g])
    return batch, [lp for s in samples for lp in s.rollout_logprobs]


def _weights(trainer: DiffusionTrainer) -> dict[str, str]:
    return {n: tensor_checksum(t) for bucket in trainer.iter_weights(1 << 20) for n, t in bucket}


def _weight_sum(trainer: DiffusionTrainer) -> float:
    return float(sum(t.double().sum() for bucket in trainer.iter_weights(1 << 20) for _, t in bucket))


def _rank(rank: int, world_size: int, policy: str, out_dir: str, port: int) -> None:
    from miles_fsdp.distributed import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    dist = init_distributed(rank, world_size, master_port=port)
    out = Path(out_dir)
    train = TrainSettings(model_path=policy, lr=1e-3, num_rollouts=2, grad_clip=1.0)
    algo = FlowGRPO(FlowGRPOSettings(kl_coef=0.1, clip_eps=0.2))
    batch, rollout = make_batch(policy)
    share = batch.shard(rank, world_size)

    def new_trainer() -> DiffusionTrainer:
        trainer = DiffusionTrainer(
            train, DiffusionTrainerSettings(max_pairs_per_micro_batch=4), FP32(FP32.Settings()), dist
        )
        trainer.setup()
        return trainer

    trainer = new_trainer()
    scored = trainer.compute_logprobs(share).logprobs
    share.set_token_field("old_logprobs", scored)
    first = trainer.train_step(share, algo)
    trainer.save_checkpoint(str(out / "ckpt"))
    second = trainer.train_step(share, algo)
    continuous = _weights(trainer)
    weight_sum = _weight_sum(trainer)
    trainer.export_hf(str(out / "exported"))
    trainer.close()

    resumed_trainer = new_trainer()
    resumed_trainer.load_checkpoint(str(out / "ckpt"))
    resumed = resumed_trainer.train_step(share, algo)
    resumed_weights = _weights(resumed_trainer)
    if rank == 0:
        mine = rollout[: share.response_offsets[-1]]  # rank 0's share is the batch's first trajectories
        diff = max(abs(float(a) - b) for a, b in zip(scored.tolist(), mine, strict=True))
        results = {
            "logprob_max_diff": diff,
            "first": first,
            "second": second,
            "resumed": resumed,
            "same_weights_after_resume": resumed_weights == continuous,
            "weight_sum": weight_sum,
            "tensors": len(continuous),
        }
        (out / "results.json").write_text(json.dumps(results))
    shutdown_distributed()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    mp.spawn(_rank, args=(args.world_size, args.policy, args.out, args.port), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
