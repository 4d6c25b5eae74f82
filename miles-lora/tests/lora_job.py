"""A real 2-rank job for the tests: the fsdp trainer with the ``lora`` adapter on gloo ranks (spawned with
``torch.multiprocessing``); it runs every check in one launch and writes what it saw under ``--out``.

The tests (``test_trainer.py``) assert on those files against references computed with plain
transformers / PEFT.
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

from miles.testing.algorithms import RatioPG, RatioPGSettings
from miles.training.batch import TrainBatch

STEPS = 3
LORA = dict(
    r=4,
    alpha=8.0,
    init="random",
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj"],
)


def make_sequences(seed: int, n: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Deterministic token sequences of varied lengths and their prompt lengths."""
    rng = random.Random(seed)
    tokens, prompts = [], []
    for _ in range(n):
        p, r = rng.randint(3, 8), rng.randint(4, 10)
        tokens.append([rng.randrange(3, vocab) for _ in range(p + r)])
        prompts.append(p)
    return tokens, prompts


def make_batch(seed: int, n: int, vocab: int) -> TrainBatch:
    """:func:`make_sequences` with advantages and old / rollout logprobs."""
    tokens, prompts = make_sequences(seed, n, vocab)
    rng = random.Random(seed + 1)
    masks, adv, old = [], [], []
    for seq, p in zip(tokens, prompts, strict=True):
        r = len(seq) - p
        masks.append([1] * r)
        adv.append([rng.gauss(0.0, 1.0) for _ in range(r)])
        old.append([-math.log(vocab) + rng.uniform(-0.5, 0.5) for _ in range(r)])
    return TrainBatch.from_lists(
        tokens=tokens, prompt_lengths=prompts, loss_mask=masks, advantages=adv, old_logprobs=old, rollout_logprobs=old
    )


def _save(path: Path, values: Sequence[object]) -> None:
    from safetensors.torch import save_file

    save_file({str(i): v.contiguous() for i, v in enumerate(values)}, str(path))  # type: ignore[union-attr]


def _rank(rank: int, world_size: int, model: str, out_dir: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    from miles_lora.adapter import LoraAdapter
    from miles_lora.settings import LoraSettings

    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer

    torch.set_num_threads(1)
    out = Path(out_dir)
    ctx = init_distributed(rank, world_size, master_port=port)
    train = TrainSettings(model_path=model, lr=1e-2, num_rollouts=STEPS)  # type: ignore[call-arg]
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    evals = make_batch(7, 4, vocab)
    results: dict[str, object] = {}

    def new_trainer() -> FSDPTrainer:
        t = FSDPTrainer(train, FSDPSettings(), FP32(None), ctx)  # type: ignore[arg-type]
        t.adapter = LoraAdapter(LoraSettings(**LORA))  # type: ignore[arg-type]
        t.setup(need_ref=True)
        return t

    t = new_trainer()
    results["has_ref_copy"] = t.ref is not None
    optimizer = t._parts["actor"][1]
    results["optimizer_params"] = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    results["trainable_names"] = sorted(n for n, p in t.actor.named_parameters() if p.requires_grad)
    ref0 = t.compute_logprobs(evals, model="ref").logprobs.split(evals.response_lengths)
    lp0 = t.compute_logprobs(evals).logprobs.split(evals.response_lengths)
    for step in range(STEPS):
        algo = RatioPG(RatioPGSettings())
        t.train_step(make_batch(100 + step, 4, vocab).shard(rank, world_size), algo)
        if step == 0:
            t.save_checkpoint(str(out / "ckpt"))
            resume_lp = t.compute_logprobs(evals).logprobs.split(evals.response_lengths)
    results["optimizer_state_numel"] = sum(
        v.numel() for s in optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")
    )
    lp = t.compute_logprobs(evals).logprobs.split(evals.response_lengths)
    ref = t.compute_logprobs(evals, model="ref").logprobs.split(evals.response_lengths)
    pushed = [pair for bucket in t.iter_weights(bucket_bytes=4096) for pair in bucket]
    t.export_hf(str(out / "export"))
    if rank == 0:
        _save(out / "ref0.safetensors", ref0)
        _save(out / "lp0.safetensors", lp0)
        _save(out / "lp.safetensors", lp)
        _save(out / "ref.safetensors", ref)
        from safetensors.torch import save_file

        save_file({n: x.contiguous() for n, x in pushed}, str(out / "pushed.safetensors"))
    t.close()
    # resume: a fresh trainer from the checkpoint taken after step 1 gives that step's logprobs
    t2 = new_trainer()
    t2.load_checkpoint(str(out / "ckpt"))
    results["resumed_step"] = t2.step
    resumed = t2.compute_logprobs(evals).logprobs.split(evals.response_lengths)
    results["resume_max_diff"] = max(float((a - b).abs().max()) for a, b in zip(resumed, resume_lp, strict=True))
    t2.close()
    (out / f"results_rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    shutdown_distributed()


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
