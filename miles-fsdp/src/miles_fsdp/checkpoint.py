"""Sharded checkpoints with ``torch.distributed.checkpoint`` and loading from a Hugging Face directory.

A checkpoint directory holds:

- the DCP files (``.metadata``, ``__<rank>_0.distcp``) of the model and optimizer state (and the critic's
  when there is one), each rank writing its shards;
- ``trainer_state.json``: step and scheduler state;
- ``rng/rank<r>.safetensors``: each rank's torch CPU (and CUDA) generator states.

Nothing is pickled outside DCP's own format.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from miles.training.rng import load_rng_state, save_rng_state

__all__ = ["is_dcp_checkpoint", "load_hf_weights", "load_sharded", "save_sharded"]

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


def is_dcp_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a checkpoint written by :func:`save_sharded`."""
    return (Path(path) / ".metadata").exists() and (Path(path) / STATE_FILE).exists()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


Parts = dict[str, tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]]
"""``{"actor": (model, optimizer, scheduler), "critic": ...}``."""


def _app_state(parts: Parts) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for key, (model, optimizer, _) in parts.items():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state[f"{key}.model"] = model_sd
        state[f"{key}.optim"] = optim_sd
    return state


def save_sharded(
    path: str,
    parts: Parts,
    *,
    step: int,
    rank: int,
) -> None:
    """Save models + optimizers (sharded), schedulers, step and every rank's RNG states to ``path``."""

    out = Path(path)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    _barrier()
    dcp.save(_app_state(parts), checkpoint_id=str(out))
    save_rng_state(out, rank)
    if rank == 0:
        schedulers = {
            key: {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
            for key, (_, _, sched) in parts.items()
        }
        (out / STATE_FILE).write_text(json.dumps({"step": step, "schedulers": schedulers}, indent=2))
    _barrier()
    log.info("saved a sharded checkpoint of step %d to %s", step, out)


def load_sharded(
    path: str,
    parts: Parts,
    *,
    rank: int,
) -> int:
    """Restore what :func:`save_sharded` wrote into ``parts``; returns the step."""

    src = Path(path)
    state = _app_state(parts)
    dcp.load(state, checkpoint_id=str(src))
    meta = json.loads((src / STATE_FILE).read_text())
    for key, (model, optimizer, scheduler) in parts.items():
        set_state_dict(model, optimizer, model_state_dict=state[f"{key}.model"], optim_state_dict=state[f"{key}.optim"])
        sched = scheduler.state_dict()
        sched.update(meta["schedulers"][key])
        scheduler.load_state_dict(sched)
    load_rng_state(src, rank)
    _barrier()
    return int(meta["step"])


def load_hf_weights(model: nn.Module, path: str) -> None:
    """Load a Hugging Face safetensors directory into a sharded model (strict: every key must match)."""
    from safetensors.torch import load_file

    src = Path(path)
    index = src / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (src / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{src} holds neither a DCP checkpoint (.metadata) nor model.safetensors")
    full: dict[str, torch.Tensor] = {}
    for file in files:
        full.update(load_file(str(src / file)))
    keys = set(model.state_dict())
    # named_parameters lists tied weights once (lm_head.weight = embed_tokens.weight): HF saves them once
    expected = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers() if n in keys}
    missing = sorted(expected - set(full))
    unexpected = sorted(set(full) - keys)
    if missing or unexpected:
        raise KeyError(f"{src}: weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
