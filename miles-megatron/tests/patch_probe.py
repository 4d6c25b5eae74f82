"""Each CPU patch (and mbridge shim) switched off in turn, each in fresh processes: does Megatron then fail?

``python patch_probe.py MODELS OUT`` imports torch, Megatron, mbridge and the trainer once, *without*
applying any patch, then forks one child per probe (two for the 2-rank probes): the child applies every
patch except the probe's own (``MILES_MEGATRON_DISABLE_PATCHES``, as a user would), joins a gloo world
and runs the stages of a trainer's life up to the first one that needs the patch — the smallest real
operation that shows it is needed — and writes which stage it reached and the error to ``OUT``. Control
runs (nothing switched off) run the same stages and must pass, so a probe cannot fail for another
reason. ``test_cpu_patches.py`` asserts on the results.

Forking from one unpatched parent keeps every probe a process of its own (the patches are process-wide)
while paying Megatron's imports once instead of once per probe.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

STAGES = ("init", "build", "ddp", "optimizer", "forward", "step")
"""A trainer's life: parallel state, the model built and loaded through mbridge, the model in Megatron
DDP, the optimizer, a forward-only pass, a training step (forward, backward, optimizer)."""


@dataclass(frozen=True)
class Scenario:
    world: int
    arch: str
    options: dict[str, Any] = field(default_factory=dict)


SCENARIOS = {
    "dense": Scenario(1, "qwen2", {"recompute": "full"}),
    "moe": Scenario(1, "qwen2_moe"),
    "ep": Scenario(2, "qwen2_moe", {"expert_parallel": 2}),
    "sp": Scenario(2, "qwen2", {"tensor_parallel": 2, "sequence_parallel": True}),
}


@dataclass(frozen=True)
class Probe:
    scenario: str
    stage: str
    """The stage that fails without the patch (the stages before it pass)."""
    error: str
    """Part of the error it fails with."""


NO_CUDA = "Torch not compiled with CUDA enabled"
PROBES = {
    "cuda_rng": Probe("dense", "init", NO_CUDA),
    "current_device": Probe("dense", "ddp", NO_CUDA),
    "cuda_device_mode": Probe("dense", "optimizer", NO_CUDA),
    "cuda_tensor_type": Probe("dense", "optimizer", "Wrapped parameters must be one of torch.cuda.FloatTensor"),
    "recompute_mode": Probe("dense", "step", NO_CUDA),
    "cuda_streams": Probe("moe", "build", "torch.cuda.Stream requires CUDA support"),
    "moe_te_names": Probe("moe", "forward", "name 'te_general_gemm' is not defined"),
    "ep_split_sizes": Probe("ep", "forward", "all_to_all_single(): incompatible function arguments"),
    "sp_torch_norm": Probe("sp", "build", "sequence parallel not supported by torch LayerNorm"),
    "mbridge_local_spec": Probe("dense", "build", "name 'TENorm' is not defined"),
    "mbridge_local_names": Probe("dense", "build", "Unsupported parameter name: decoder.layers.0.input_layernorm"),
    "mbridge_rope_theta": Probe("dense", "build", "object has no attribute 'rope_theta'"),
}


def controls() -> dict[str, str]:
    """Per scenario, the last stage any probe of it needs: run with every patch on, it must pass."""
    last: dict[str, str] = {}
    for probe in PROBES.values():
        if STAGES.index(probe.stage) >= STAGES.index(last.get(probe.scenario, "init")):
            last[probe.scenario] = probe.stage
    return last


def _stages(rank: int, world: int, model: str, options: dict[str, Any], until: str, at: list[str]) -> None:
    """Run the stages up to ``until``, appending each to ``at`` as it starts."""
    import megatron_job as job
    import torch

    from miles.precision.builtin import FP32
    from miles.training.trainer import DistContext
    from miles_megatron.model import build_model, build_optimizer, init_parallel, load_hf_config, wrap_for_training
    from miles_megatron.settings import MegatronSettings
    from miles_megatron.trainer import MegatronTrainer

    opts = MegatronSettings(**options)
    train = job._train_settings(model)
    at.append("init")
    init_parallel(opts, device="cpu", seed=0)
    if until == "init":
        return
    at.append("build")
    config = load_hf_config(model)
    parts = build_model(config, opts, device="cpu", dtype=torch.float32, weights=model, trainable=False)
    if until == "build":
        return
    trainer = MegatronTrainer(train, opts, FP32(None), DistContext(rank, world))
    trainer.actor, trainer._hf_config = parts, config
    if until != "forward":  # a forward-only probe needs neither DDP nor an optimizer
        at.append("ddp")
        parts.module.requires_grad_(True)
        parts.module.train()
        parts.module = wrap_for_training(parts.module, opts)
        if until == "ddp":
            return
        at.append("optimizer")
        trainer.optimizer = build_optimizer(parts.module, train, opts, dtype=torch.float32)
        if until == "optimizer":
            return
    batch = job.step_batches(job._vocab(model))[0].shard(rank, world)
    if until == "forward":
        at.append("forward")
        trainer.compute_logprobs(batch)
        return
    at.append("step")
    metrics = trainer.train_step(batch, job.PolicyGradient(), temperature=1.0)
    assert metrics["grad_norm"] > 0


def _child(
    rank: int, world: int, port: int, model: str, options: dict[str, Any], until: str, disabled: str, out: Path
) -> None:
    """One rank of one probe (a forked process): its patches, its gloo world, its stages, its result file."""
    import torch.distributed as dist

    os.environ["MILES_MEGATRON_DISABLE_PATCHES"] = disabled
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    at: list[str] = []
    result = {"rank": rank, "stage": "ok", "error": ""}
    try:
        # a probe failing on one rank must not leave the other waiting long
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
        _stages(rank, world, model, options, until, at)
    except BaseException as exc:
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        result.update(stage=at[-1] if at else "process group", error=error[:2000])
    out.write_text(json.dumps(result))
    os._exit(0)  # no teardown: a failed probe may leave Megatron in any state


def _run(name: str, scenario: str, until: str, disabled: str, models: Path, out: Path) -> dict[str, Any]:
    import multiprocessing

    from miles.net import free_port

    spec = SCENARIOS[scenario]
    port = free_port("127.0.0.1")
    ctx = multiprocessing.get_context("fork")
    files = [out / f"{name}.rank{r}.json" for r in range(spec.world)]
    start = time.perf_counter()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, spec.world, port, str(models / spec.arch), spec.options, until, disabled, files[r]),
        )
        for r in range(spec.world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join()
    ranks = [json.loads(f.read_text()) if f.exists() else {"stage": "hung", "error": "no result"} for f in files]
    return {"ranks": ranks, "seconds": time.perf_counter() - start}


def main() -> None:
    models, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    # the heavy imports, once, before any fork; no patch is applied in this process
    import mbridge  # noqa: F401
    import megatron.core.distributed
    import megatron.core.models.gpt
    import megatron.core.optimizer
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron_job  # noqa: F401
    import transformers  # noqa: F401

    import miles_megatron.model
    import miles_megatron.step
    import miles_megatron.trainer  # noqa: F401
    from miles_megatron.cpu_patches import applied_patches

    assert applied_patches() == []
    results: dict[str, Any] = {}
    for scenario, until in controls().items():
        results[f"control:{scenario}"] = _run(f"control-{scenario}", scenario, until, "", models, out)
    for name, probe in PROBES.items():
        results[name] = _run(name, probe.scenario, probe.stage, name, models, out)
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
