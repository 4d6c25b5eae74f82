"""A real multi-rank job for the tests: the fsdp trainer on ``--world-size`` gloo ranks (spawned with
``torch.multiprocessing``) runs several checks in one launch and writes what it saw under ``--out``.

The tests (``test_trainer.py``) assert on those files against references they compute themselves.
Also holds the test algorithms and the deterministic data, so the tests and the job share them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from miles.algorithms.base import Aggregation
from miles.testing.algorithms import RatioPG, RatioPGSettings, RatioPGWithCritic
from miles.training.batch import TrainBatch

STEPS = 4
SAVE_AFTER = 2
SEQS_PER_STEP = 4
TEMPERATURE = 0.9
EVAL_TEMPERATURE = 0.7
MICRO_BATCH_TOKENS = 30
"""Small enough that ranks need different micro-batch counts in some steps (empty micro-batches run)."""
AGGREGATIONS: tuple[Aggregation, ...] = ("token_mean", "seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
SEQ_LEN_NORM = 16.0
TRAIN = dict(
    lr=2e-4,
    min_lr=2e-5,
    lr_schedule="cosine",
    warmup_steps=2,
    num_rollouts=5,
    weight_decay=0.01,
    adam_betas=(0.9, 0.95),
    adam_eps=1e-8,
    grad_clip=0.5,
    max_tokens_per_micro_batch=MICRO_BATCH_TOKENS,
)


def PolicyGradient(aggregation: Aggregation = "token_mean") -> RatioPG:
    """The reference policy gradient of the kit, with this test's aggregation and normalising constant."""
    return RatioPG(RatioPGSettings(aggregation=aggregation, seq_len_norm=SEQ_LEN_NORM))


def ValueRegression() -> RatioPGWithCritic:
    """The reference policy gradient plus a critic's squared error."""
    return RatioPGWithCritic(RatioPGSettings(seq_len_norm=SEQ_LEN_NORM))


def make_batch(seed: int, n: int, vocab: int) -> TrainBatch:
    """Deterministic sequences of varied lengths with advantages, old / rollout logprobs and returns."""
    rng = random.Random(seed)
    tokens, prompts, masks, adv, old, rollout, returns = [], [], [], [], [], [], []
    for _ in range(n):
        p, r = rng.randint(3, 8), rng.randint(4, 12)
        tokens.append([rng.randrange(3, vocab) for _ in range(p + r)])
        prompts.append(p)
        masks.append([0 if rng.random() < 0.2 else 1 for _ in range(r)])
        masks[-1][0] = 1
        adv.append([rng.gauss(0.0, 1.0) for _ in range(r)])
        old.append([-math.log(vocab) + rng.uniform(-0.5, 0.5) for _ in range(r)])
        rollout.append([o + rng.uniform(-0.1, 0.1) for o in old[-1]])
        returns.append([0.5 + rng.uniform(-0.1, 0.1) for _ in range(r)])
    return TrainBatch.from_lists(
        tokens=tokens,
        prompt_lengths=prompts,
        loss_mask=masks,
        advantages=adv,
        old_logprobs=old,
        rollout_logprobs=rollout,
        returns=returns,
    )


def step_batches(vocab: int) -> list[TrainBatch]:
    return [make_batch(100 + s, SEQS_PER_STEP, vocab) for s in range(STEPS)]


def eval_batch(vocab: int, world_size: int) -> TrainBatch:
    return make_batch(7, 6, vocab)


def _save_logprobs(path: Path, indices: Sequence[int], values: Sequence[object]) -> None:
    from safetensors.torch import save_file

    save_file({f"{i}": v.contiguous() for i, v in zip(indices, values, strict=True)}, str(path))  # type: ignore[union-attr]


def _rank(rank: int, world_size: int, model: str, out_dir: str, port: int) -> None:
    import torch

    from miles.precision.builtin import BF16, FP32
    from miles.settings.model import TrainSettings
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    torch.set_num_threads(1)
    out = Path(out_dir)
    ctx = init_distributed(rank, world_size, master_port=port)
    train = TrainSettings(model_path=model, **TRAIN)  # type: ignore[arg-type]
    options = FSDPSettings(activation_checkpointing=world_size == 2)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    batches = step_batches(vocab)
    evals = eval_batch(vocab, world_size)
    per = len(evals) // world_size
    eval_idx = list(range(rank * per, (rank + 1) * per))
    my_eval = evals.shard(rank, world_size)
    results: dict[str, object] = {}

    def new_trainer(precision: object = None, opts: FSDPSettings = options, **setup: bool) -> FSDPTrainer:
        t = FSDPTrainer(train, opts, precision or FP32(None), ctx)  # type: ignore[arg-type]
        t.setup(**setup)
        return t

    # 1. logprobs of the initial model, iter_weights, then STEPS train steps with a checkpoint in between
    t = new_trainer(need_ref=True)
    lp = t.compute_logprobs(my_eval, temperature=EVAL_TEMPERATURE, with_entropy=True)
    assert lp.entropy is not None
    _save_logprobs(out / f"lp0_rank{rank}.safetensors", eval_idx, lp.logprobs.split(my_eval.response_lengths))
    _save_logprobs(out / f"ent0_rank{rank}.safetensors", eval_idx, lp.entropy.split(my_eval.response_lengths))
    buckets = [[(name, list(t_.shape)) for name, t_ in bucket] for bucket in t.iter_weights(bucket_bytes=20_000)]
    results["weight_buckets"] = buckets
    metrics = []
    for step in range(STEPS):
        algo = PolicyGradient(AGGREGATIONS[step])
        metrics.append(t.train_step(batches[step].shard(rank, world_size), algo, temperature=TEMPERATURE))
        if step + 1 == SAVE_AFTER:
            t.save_checkpoint(str(out / "ckpt"))
    results["metrics"] = metrics
    results["step_after_run"] = t.step
    t.export_hf(str(out / "hf_full"), bucket_bytes=50_000)
    _save_shards(t, out / f"shards_rank{rank}")
    ref = t.compute_logprobs(my_eval, model="ref", temperature=EVAL_TEMPERATURE)
    _save_logprobs(out / f"ref_rank{rank}.safetensors", eval_idx, ref.logprobs.split(my_eval.response_lengths))
    t.close()

    # 2. resume from the sharded checkpoint and finish the run
    t = new_trainer()
    t.load_checkpoint(str(out / "ckpt"))
    results["step_after_resume"] = t.step
    results["resumed_metrics"] = [
        t.train_step(batches[s].shard(rank, world_size), PolicyGradient(AGGREGATIONS[s]), temperature=TEMPERATURE)
        for s in range(SAVE_AFTER, STEPS)
    ]
    t.export_hf(str(out / "hf_resumed"))
    t.close()

    # 3. resume from the HF export: same logprobs as a plain HF forward of that directory
    t = new_trainer()
    t.load_checkpoint(str(out / "hf_full"))
    lp = t.compute_logprobs(my_eval, temperature=EVAL_TEMPERATURE)
    _save_logprobs(out / f"lp_hf_rank{rank}.safetensors", eval_idx, lp.logprobs.split(my_eval.response_lengths))
    t.close()

    # 4. bf16 parameters / fp32 reduction: close to fp32 logprobs, trains, master weights stay fp32
    t = new_trainer(BF16(None))
    lp = t.compute_logprobs(my_eval, temperature=EVAL_TEMPERATURE)
    _save_logprobs(out / f"lp_bf16_rank{rank}.safetensors", eval_idx, lp.logprobs.split(my_eval.response_lengths))
    results["bf16_metrics"] = t.train_step(
        batches[0].shard(rank, world_size), PolicyGradient(), temperature=TEMPERATURE
    )
    results["bf16_master_dtypes"] = sorted({str(p.dtype) for p in t.actor.parameters()})
    t.close()

    # 5. critic: values regress towards returns
    t = new_trainer(opts=options.model_copy(update={"critic_lr": 2e-3}), need_values=True)
    data = batches[0].shard(rank, world_size)
    mse = []
    for _ in range(4):
        values = t.compute_values(data).split(data.response_lengths)
        returns = data.rows("returns")
        assert returns is not None
        err = sum(float(((v - r) ** 2).sum()) for v, r in zip(values, returns, strict=True))
        mse.append(err / sum(len(r) for r in returns))
        results.setdefault("critic_metrics", []).append(t.train_step(data, ValueRegression(), temperature=TEMPERATURE))  # type: ignore[union-attr]
    results["value_shapes_ok"] = all(len(v) == n for v, n in zip(values, data.response_lengths, strict=True))
    results["critic_mse"] = mse
    t.close()

    (out / f"results_rank{rank}.json").write_text(json.dumps(results))
    shutdown_distributed()


def _save_shards(trainer: object, folder: Path) -> None:
    """This rank's ``iter_weight_shards`` (tensors plus where each sits in the full tensor)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors, places = {}, {}
    for shard in trainer.iter_weight_shards():  # type: ignore[attr-defined]
        tensors[shard.name] = shard.tensor.detach().clone().contiguous()
        places[shard.name] = {"global_shape": list(shard.global_shape), "offsets": list(shard.offsets)}
    save_file(tensors, str(folder / "shards.safetensors"))
    (folder / "places.json").write_text(json.dumps(places))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(args.world_size, args.model, args.out, args.port), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
