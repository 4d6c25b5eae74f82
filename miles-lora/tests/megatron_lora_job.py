"""A real 2-rank job for the tests: the megatron trainer with the ``lora`` adapter on gloo ranks (spawned
with ``torch.multiprocessing``), at three layouts one after the other in one launch — data parallel 2,
tensor parallel 2 with sequence parallelism, pipeline parallel 2 — each from the same random adapter
through the same steps; a checkpoint and resume, and both exports at TP=2. ``--fsdp`` runs the reference
instead: the fsdp trainer with LoRA on one rank, given the adapter the TP=2 run trained.

Megatron's CPU patches are process-wide: this runs in its own processes. The tests (``test_megatron.py``)
assert on what it writes under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STEPS = 2
SAVE_AFTER = 1
LORA = dict(r=4, alpha=8, init="random")
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2": dict(),
    "tp2": dict(tensor_parallel=2, sequence_parallel=True),
    "pp2": dict(pipeline_parallel=2),
}
EXPORTED = "tp2"
"""The layout that also checkpoints, resumes and exports."""


def _save(path: Path, tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path))


def _logprobs(values: Any, batch: Any) -> dict[str, Any]:
    """Each sequence's logprobs of ``batch`` (``values`` packed as its per-token fields), by index."""
    return {str(i): v for i, v in enumerate(values.split(batch.response_lengths))}


def _adapter(trainer: Any) -> dict[str, Any]:
    return {n: t for bucket in trainer.iter_weights(bucket_bytes=2048) for n, t in bucket}


def _megatron_rank(rank: int, world: int, model: str, out_dir: str, port: int) -> None:
    import torch
    import torch.distributed as dist
    from lora_job import make_batch
    from miles_lora.adapter import LoraAdapter
    from miles_lora.settings import LoraSettings

    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles.testing.algorithms import RatioPG
    from miles.training.trainer import DistContext
    from miles_megatron.settings import MegatronSettings
    from miles_megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = DistContext(rank=rank, world_size=world)
    train = TrainSettings(model_path=model, lr=1e-2, num_rollouts=STEPS)  # type: ignore[call-arg]
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    evals = make_batch(7, 4, vocab).shard(rank, world)

    def new_trainer(options: MegatronSettings) -> MegatronTrainer:
        trainer = MegatronTrainer(train, options, FP32(None), ctx)
        trainer.adapter = LoraAdapter(LoraSettings(**LORA))  # type: ignore[arg-type]
        trainer.setup(need_ref=True)
        return trainer

    for layout, options in LAYOUTS.items():
        out = Path(out_dir) / layout
        out.mkdir(parents=True, exist_ok=True)
        t = new_trainer(MegatronSettings(**options))
        lora = [p for n, p in t.model_parts().module.named_parameters() if ".lora_" in n]
        results: dict[str, Any] = {
            "has_ref_copy": t.ref is not None,
            "lora_numel": sum(p.numel() for p in lora),
            "trainable_names": sorted(n for n, p in t.model_parts().module.named_parameters() if p.requires_grad),
            "optimizer_params": sum(p.numel() for g in t.optimizer.param_groups for p in g["params"]),
        }
        tensors = {"adapter0": _adapter(t)}
        logprobs = {"lp0": t.compute_logprobs(evals).logprobs, "ref0": t.compute_logprobs(evals, model="ref").logprobs}
        metrics = []
        for step in range(STEPS):
            metrics.append(t.train_step(make_batch(100 + step, 4, vocab).shard(rank, world), RatioPG()))
            if layout == EXPORTED and step + 1 == SAVE_AFTER:
                t.save_checkpoint(str(out / "ckpt"))
                logprobs["saved"] = t.compute_logprobs(evals).logprobs
        results["metrics"] = metrics
        results["optimizer_state_numel"] = sum(
            v.numel()
            for s in t.optimizer.optimizer.state.values()
            for k, v in s.items()
            if k in ("exp_avg", "exp_avg_sq")
        )
        logprobs["lp"] = t.compute_logprobs(evals).logprobs
        logprobs["ref"] = t.compute_logprobs(evals, model="ref").logprobs
        tensors["adapter"] = _adapter(t)
        if layout == EXPORTED:
            t.export_hf(str(out / "export"))
        t.close()
        if layout == EXPORTED:  # a fresh trainer from the checkpoint taken after step 1
            t = new_trainer(MegatronSettings(**options))
            t.load_checkpoint(str(out / "ckpt"))
            results["resumed_step"] = t.step
            logprobs["resumed"] = t.compute_logprobs(evals).logprobs
            t.close()
        for name, values in logprobs.items():  # each rank its own sequences
            _save(out / f"{name}_rank{rank}.safetensors", _logprobs(values, evals))
        if rank == 0:
            for name, adapter in tensors.items():
                _save(out / f"{name}.safetensors", adapter)
        (out / f"results_rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_fsdp_reference(model: str, adapter_file: str, out_dir: str, port: int) -> None:
    """The fsdp trainer with LoRA on one rank, its adapter parameters set to ``adapter_file``'s tensors."""
    import torch
    from lora_job import make_batch
    from miles_lora.adapter import LoraAdapter, peft_file_name
    from miles_lora.settings import LoraSettings
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, distribute_tensor

    from miles.precision.builtin import FP32
    from miles.settings.model import TrainSettings
    from miles_fsdp.distributed import init_distributed, shutdown_distributed
    from miles_fsdp.settings import FSDPSettings
    from miles_fsdp.trainer import FSDPTrainer
    from miles_fsdp.weights import hf_name

    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ctx = init_distributed(0, 1, master_port=port)
    train = TrainSettings(model_path=model, lr=1e-2, num_rollouts=STEPS)  # type: ignore[call-arg]
    t = FSDPTrainer(train, FSDPSettings(), FP32(None), ctx)  # type: ignore[arg-type]
    t.adapter = LoraAdapter(LoraSettings(**LORA))  # type: ignore[arg-type]
    t.setup()
    adapter = load_file(adapter_file)
    copied = 0
    with torch.no_grad():
        for name, param in t.actor.named_parameters():
            file_name = peft_file_name(hf_name(name))
            if file_name is not None:
                value = adapter[file_name]
                if isinstance(param, DTensor):  # the fsdp trainer's parameters are sharded (a mesh of one)
                    value = distribute_tensor(value, param.device_mesh, param.placements)
                param.copy_(value)
                copied += 1
    if copied != len(adapter):
        raise RuntimeError(f"set {copied} of the adapter's {len(adapter)} tensors")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    evals = make_batch(7, 4, vocab)
    _save(out / "lp.safetensors", _logprobs(t.compute_logprobs(evals).logprobs, evals))
    t.close()
    shutdown_distributed()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fsdp", metavar="ADAPTER", help="run the fsdp reference with this adapter file")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.fsdp:
        run_fsdp_reference(args.model, args.fsdp, args.out, args.port)
        return
    import torch.multiprocessing as mp

    mp.spawn(_megatron_rank, args=(2, args.model, args.out, args.port), nprocs=2, join=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
