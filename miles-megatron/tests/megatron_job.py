"""Real multi-rank jobs for the tests: the megatron trainer on ``--world-size`` gloo ranks (spawned with
``torch.multiprocessing``), several layouts one after the other in one launch (each launch costs seconds
of imports), writing what it saw under ``--out``. Also the FSDP reference run (``--fsdp``, one rank,
without the Megatron patches) on the same data, so the tests compare the two backends.

Every layout trains with a PPO critic set up (``need_values``): the steps in :data:`CRITIC_STEPS` use the
kit's ``RatioPGWithCritic`` (value head and policy trained through one loss), the others ``RatioPG``
(the critic idle, as miles-fsdp leaves it); the checkpoint carries the critic. After the resumed run,
the critic's values and one top-k distillation step (the student's top-k logprobs recorded) follow.

The tests (``test_equality.py`` ...) assert on those files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from miles.algorithms.base import Aggregation, LossInputs, LossOutput
from miles.algorithms.builtin import Distill
from miles.algorithms.settings import DistillSettings
from miles.testing.algorithms import RatioPG, RatioPGSettings, RatioPGWithCritic
from miles.training.batch import TrainBatch

STEPS = 4
SAVE_AFTER = 2
SEQS_PER_STEP = 4
TEMPERATURE = 0.9
EVAL_TEMPERATURE = 0.7
MICRO_BATCH_TOKENS = 30
AGGREGATIONS: tuple[Aggregation, ...] = ("token_mean", "seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
SEQ_LEN_NORM = 16.0
CRITIC_STEPS = (1, 3)
"""Steps whose algorithm also trains the critic (one before the checkpoint, one after)."""
CRITIC = dict(value_head_init_std=0.02, critic_lr=2e-3)
"""The critic's settings, the same in both backends."""
TOPK = 3
DISTILL_TEMPERATURE = 0.8
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
R3_LAYOUTS: dict[str, dict[str, Any]] = {
    "r3_tp2": dict(tensor_parallel=2, sequence_parallel=True),
    "r3_pp2": dict(pipeline_parallel=2),
}
"""MoE layouts whose routing replay is checked beside expert parallel 2."""
ON_A_THREAD = "dp2"
"""The layout whose steps run on another thread than its set-up (torch's function modes are per thread)."""
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": dict(tensor_parallel=2, sequence_parallel=True),
    "pp2": dict(pipeline_parallel=2),
    "dp2": dict(distributed_optimizer=True, recompute="full"),
}


def PolicyGradient(aggregation: Aggregation = "token_mean") -> RatioPG:
    """The kit's reference policy gradient with this test's aggregation and normalising constant."""
    return RatioPG(RatioPGSettings(aggregation=aggregation, seq_len_norm=SEQ_LEN_NORM))


def algorithm_of(step: int) -> RatioPG:
    """Step ``step``'s algorithm: the policy gradient, with the critic's squared error on :data:`CRITIC_STEPS`."""
    settings = RatioPGSettings(aggregation=AGGREGATIONS[step], seq_len_norm=SEQ_LEN_NORM)
    return RatioPGWithCritic(settings) if step in CRITIC_STEPS else RatioPG(settings)


class RecordingDistill(Distill):
    """Top-k distillation that keeps, per micro-batch, the student's and the teacher's top-k logprobs."""

    def __init__(self) -> None:
        super().__init__(DistillSettings(distill_mode="topk", distill_topk=TOPK))
        self.seen: list[tuple[list[list[float]], list[list[float]]]] = []

    def loss(self, inputs: LossInputs) -> LossOutput:
        assert inputs.student_topk_logprobs is not None and inputs.teacher_topk_logprobs is not None
        assert inputs.student_topk_logprobs.requires_grad
        self.seen.append((inputs.student_topk_logprobs.tolist(), inputs.teacher_topk_logprobs.tolist()))
        return super().loss(inputs)


def distill_batch(vocab: int) -> TrainBatch:
    """Sequences with a made-up teacher's top-k ids and (distinct, sorted) logprobs per response token."""
    rng = random.Random(11)
    tokens, prompts, ids, lps = [], [], [], []
    for prompt_len, response_len in ((5, 6), (3, 9), (7, 4), (4, 8)):
        tokens.append([rng.randrange(3, vocab) for _ in range(prompt_len + response_len)])
        prompts.append(prompt_len)
        ids.append([rng.sample(range(vocab), TOPK) for _ in range(response_len)])
        lps.append([sorted((-rng.uniform(0.1, 4.0) for _ in range(TOPK)), reverse=True) for _ in range(response_len)])
    return TrainBatch.from_lists(
        tokens=tokens,
        prompt_lengths=prompts,
        loss_mask=[[1] * (len(t) - p) for t, p in zip(tokens, prompts, strict=True)],
        advantages=[[0.0] * (len(t) - p) for t, p in zip(tokens, prompts, strict=True)],
        teacher_topk_ids=ids,
        teacher_topk_logprobs=lps,
    )


def _critic_and_distill(trainer: Any, batch_of: Any, vocab: int) -> dict[str, Any]:
    """After the run: the trained critic's values of the eval batch, then one top-k distillation step."""
    evals = batch_of(eval_batch(vocab))
    values = trainer.compute_values(evals).split(evals.response_lengths)
    distill = RecordingDistill()
    metrics = trainer.train_step(batch_of(distill_batch(vocab)), distill, temperature=DISTILL_TEMPERATURE)
    return {"values": [v.tolist() for v in values], "distill_metrics": metrics, "distill_seen": distill.seen}


def _nan_step(trainer: Any, rank: int, world: int, vocab: int) -> dict[str, Any]:
    """A step whose advantages are NaN: refused (the error's message), the step count and weights kept."""
    import torch

    from miles.errors import NonFiniteStepError

    batch = make_batch(300, SEQS_PER_STEP, vocab)
    batch.set_token_field("advantages", torch.full_like(batch.advantages, float("nan")))  # type: ignore[arg-type]
    before = {n: t.clone() for bucket in trainer.iter_weights(bucket_bytes=1 << 20) for n, t in bucket}
    step = trainer.step
    try:
        trainer.train_step(batch.shard(rank, world), PolicyGradient(), temperature=TEMPERATURE)
        error = None
    except NonFiniteStepError as exc:
        error = str(exc)
    after = {n: t for bucket in trainer.iter_weights(bucket_bytes=1 << 20) for n, t in bucket}
    same = before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    return {"error": error, "step_before": step, "step_after": trainer.step, "weights_unchanged": same}


def make_batch(seed: int, n: int, vocab: int) -> TrainBatch:
    """Deterministic sequences of varied lengths with advantages, old and rollout logprobs."""
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
        returns.append([0.5 + rng.uniform(-0.3, 0.3) for _ in range(r)])
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


def eval_batch(vocab: int) -> TrainBatch:
    return make_batch(7, 6, vocab)


def kept_sets(batch: TrainBatch, vocab: int) -> list[list[int]]:
    """A kept set per response token of ``batch``, as top-k sampling reports them (issue 40's sampling-mask
    replay): the token itself and four ids spread over the vocabulary (so with tensor parallelism the set spans
    both halves of the vocabulary-parallel logits)."""
    targets = [t for seq, p in zip(batch.sequences(), batch.prompt_lengths.tolist(), strict=True) for t in seq[p:]]
    return [[t, *((t + 37 * j) % vocab for j in range(1, 5))] for t in targets]


def with_kept_sets(batch: TrainBatch, vocab: int) -> TrainBatch:
    """``batch`` whose every response token carries its :func:`kept_sets` entry in the engine's logit-mask
    rows (:func:`miles.training.logit_masks.encode_kept`), as a sample with ``sampling_mask`` packs."""
    import torch

    from miles.training.logit_masks import LOGIT_MASK_IDS, encode_kept

    out = batch.select(range(len(batch)))
    out.response_tensors[LOGIT_MASK_IDS] = torch.tensor([encode_kept(k) for k in kept_sets(batch, vocab)])
    return out


def _vocab(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def _train_settings(model: str, **extra: Any) -> Any:
    from miles.settings.model import TrainSettings

    return TrainSettings(model_path=model, **TRAIN, **extra)  # type: ignore[arg-type]


def with_forced_routing(batch: TrainBatch, model: str) -> TrainBatch:
    """``batch`` with engine routing data (``ROUTED_EXPERTS``) that the model would rarely choose itself:
    position ``t`` of layer ``l`` routed to experts ``(3t + l + j) % E``; the last token of each sequence has
    none (``-1``), as from the engine."""
    import torch

    from miles.training.routing import ROUTED_EXPERTS

    config = json.loads((Path(model) / "config.json").read_text())
    layers, k = config["num_hidden_layers"], config["num_experts_per_tok"]
    experts = config.get("num_experts", config.get("num_local_experts"))
    rows = []
    for n in batch.lengths:
        t = torch.arange(n)[:, None, None]
        l = torch.arange(layers)[None, :, None]  # noqa: E741
        j = torch.arange(k)[None, None, :]
        table = (3 * t + l + j) % experts
        table[-1] = -1
        rows.append(table)
    out = batch.select(range(len(batch)))
    out.token_tensors[ROUTED_EXPERTS] = torch.cat(rows).to(torch.int16)
    return out


def _run_layout(trainer: Any, rank: int, world: int, model: str, out: Path) -> dict[str, Any]:
    """Logprobs of the initial model, STEPS steps with a checkpoint after SAVE_AFTER, HF export."""
    vocab = _vocab(model)
    evals = eval_batch(vocab)
    my_eval = evals.shard(rank, world)
    lp = trainer.compute_logprobs(my_eval, temperature=EVAL_TEMPERATURE, with_entropy=True)
    assert lp.entropy is not None
    results: dict[str, Any] = {
        "logprobs": [t.tolist() for t in lp.logprobs.split(my_eval.response_lengths)],
        "entropy": [t.tolist() for t in lp.entropy.split(my_eval.response_lengths)],
        "eval_indices": list(range(rank * len(my_eval), (rank + 1) * len(my_eval))),
    }
    kept = with_kept_sets(evals, vocab).shard(rank, world)
    renormalised = trainer.compute_logprobs(kept, temperature=EVAL_TEMPERATURE).logprobs
    results["kept_logprobs"] = [t.tolist() for t in renormalised.split(my_eval.response_lengths)]
    results["buckets"] = [[(n, list(t.shape)) for n, t in b] for b in trainer.iter_weights(bucket_bytes=20_000)]
    metrics = []
    for step, batch in enumerate(step_batches(vocab)):
        metrics.append(trainer.train_step(batch.shard(rank, world), algorithm_of(step), temperature=TEMPERATURE))
        if step + 1 == SAVE_AFTER:
            trainer.save_checkpoint(str(out / "ckpt"))
    results["metrics"] = metrics
    trainer.export_hf(str(out / "hf_full"), bucket_bytes=50_000)
    return results


def _megatron_rank(
    rank: int, world: int, model: str, moe_model: str | None, out_dir: str, port: int, layouts: list[str]
) -> None:
    import torch

    from miles.precision.builtin import FP32
    from miles.training.trainer import DistContext
    from miles_megatron.settings import MegatronSettings
    from miles_megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = DistContext(rank=rank, world_size=world)
    train = _train_settings(model)
    vocab = _vocab(model)
    for layout in layouts:
        out = Path(out_dir) / layout
        out.mkdir(parents=True, exist_ok=True)
        options = MegatronSettings(**LAYOUTS[layout], **CRITIC)
        trainer = MegatronTrainer(train, options, FP32(None), ctx)
        trainer.setup(need_ref=layout == "tp2", need_values=True)
        if layout == ON_A_THREAD:  # as the async modes do: set up here, train on a dedicated thread
            with ThreadPoolExecutor(max_workers=1) as pool:
                results = pool.submit(_run_layout, trainer, rank, world, model, out).result()
        else:
            results = _run_layout(trainer, rank, world, model, out)
        if layout == "tp2":
            my_eval = eval_batch(vocab).shard(rank, world)
            ref = trainer.compute_logprobs(my_eval, model="ref", temperature=EVAL_TEMPERATURE)
            results["ref_logprobs"] = [t.tolist() for t in ref.logprobs.split(my_eval.response_lengths)]
        trainer.close()
        # resume from the checkpoint and finish the run
        trainer = MegatronTrainer(train, options, FP32(None), ctx)
        trainer.setup(need_values=True)
        trainer.load_checkpoint(str(out / "ckpt"))
        results["step_after_resume"] = trainer.step
        results["resumed_metrics"] = [
            trainer.train_step(b.shard(rank, world), algorithm_of(s), temperature=TEMPERATURE)
            for s, b in enumerate(step_batches(vocab))
            if s >= SAVE_AFTER
        ]
        trainer.export_hf(str(out / "hf_resumed"))
        results.update(_critic_and_distill(trainer, lambda b: b.shard(rank, world), vocab))
        trainer.export_hf(str(out / "hf_distilled"))
        trainer.close()
        (out / f"results_rank{rank}.json").write_text(json.dumps(results))
    if moe_model is not None:
        out = Path(out_dir) / "ep2"
        out.mkdir(parents=True, exist_ok=True)
        options = MegatronSettings(expert_parallel=2)
        trainer = MegatronTrainer(_train_settings(moe_model), options, FP32(None), ctx)
        trainer.setup()
        evals = eval_batch(_vocab(moe_model))
        lp = trainer.compute_logprobs(evals.shard(rank, world), temperature=EVAL_TEMPERATURE)
        results = {"logprobs": [t.tolist() for t in lp.logprobs.split(evals.shard(rank, world).response_lengths)]}
        results["buckets"] = [[(n, list(t.shape)) for n, t in b] for b in trainer.iter_weights(bucket_bytes=1 << 20)]
        results["metrics"] = [
            trainer.train_step(b.shard(rank, world), PolicyGradient(AGGREGATIONS[s]), temperature=TEMPERATURE)
            for s, b in enumerate(step_batches(_vocab(moe_model))[:1])
        ]
        trainer.export_hf(str(out / "hf"))
        results["nan_step"] = _nan_step(trainer, rank, world, _vocab(moe_model))
        trainer.close()
        # R3: the engine's experts replayed by Megatron-Core's router hook, then one step with them
        trainer = MegatronTrainer(_train_settings(moe_model, routing_replay=True), options, FP32(None), ctx)
        trainer.setup()
        forced = with_forced_routing(evals, moe_model)
        mine = forced.shard(rank, world)
        lp = trainer.compute_logprobs(mine, temperature=EVAL_TEMPERATURE)
        results["r3_logprobs"] = [t.tolist() for t in lp.logprobs.split(mine.response_lengths)]
        step = with_forced_routing(step_batches(_vocab(moe_model))[0], moe_model)
        results["r3_metrics"] = trainer.train_step(step.shard(rank, world), PolicyGradient(), temperature=TEMPERATURE)
        trainer.close()
        for name, layout in R3_LAYOUTS.items():  # each router's tokens and layers under TP + SP and PP
            trainer = MegatronTrainer(
                _train_settings(moe_model, routing_replay=True), MegatronSettings(**layout), FP32(None), ctx
            )
            trainer.setup()
            lp = trainer.compute_logprobs(mine, temperature=EVAL_TEMPERATURE)
            results[f"{name}_logprobs"] = [t.tolist() for t in lp.logprobs.split(mine.response_lengths)]
            trainer.close()
        (out / f"results_rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_fsdp_reference(model: str, out_dir: str, port: int) -> None:
    """miles-fsdp on one rank, same data and algorithms (critic included): metrics, values, the HF exports."""
    import torch

    from miles.precision.builtin import FP32
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ctx = init_distributed(0, 1, master_port=port)
    trainer = FSDPTrainer(_train_settings(model), FSDPSettings(**CRITIC), FP32(None), ctx)  # type: ignore[arg-type]
    trainer.setup(need_values=True)
    vocab = _vocab(model)
    evals = eval_batch(vocab)
    lp = trainer.compute_logprobs(evals, temperature=EVAL_TEMPERATURE, with_entropy=True)
    assert lp.entropy is not None
    results: dict[str, Any] = {
        "logprobs": [t.tolist() for t in lp.logprobs.split(evals.response_lengths)],
        "entropy": [t.tolist() for t in lp.entropy.split(evals.response_lengths)],
    }
    results["metrics"] = [
        trainer.train_step(b, algorithm_of(s), temperature=TEMPERATURE) for s, b in enumerate(step_batches(vocab))
    ]
    trainer.export_hf(str(out / "hf_full"))
    results.update(_critic_and_distill(trainer, lambda b: b, vocab))
    trainer.export_hf(str(out / "hf_distilled"))
    (out / "results.json").write_text(json.dumps(results))
    trainer.close()
    shutdown_distributed()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", required=True)
    parser.add_argument("--moe-model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--fsdp", action="store_true", help="run the miles-fsdp reference instead")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.fsdp:
        run_fsdp_reference(args.model, args.out, args.port)
        return
    import torch.multiprocessing as mp

    layouts = [x for x in args.layouts.split(",") if x]
    mp.spawn(
        _megatron_rank,
        args=(args.world_size, args.model, args.moe_model, args.out, args.port, layouts),
        nprocs=args.world_size,
        join=True,
    )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
