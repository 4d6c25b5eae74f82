"""Checkpoints with ``megatron.core.dist_checkpointing``: model and optimizer (sharded as the layout
holds them), the step, and every rank's RNG state.

A checkpoint directory holds Megatron's distributed-checkpoint files (``metadata.json``, torch's pickled
``.metadata``, ``common.pt`` written by Megatron, the ``.distcp`` shards; the pickles are checked by
:mod:`miles_megatron.checkpoint_safety` before every load), ``trainer_state.json`` (step; the learning rate is a
function of it) and ``rng/rank<r>.safetensors``. The distributed optimizer's state is saved
``dp_reshardable``. Loading needs the same parallel layout; weights only move between layouts through
a HF export (:meth:`~miles_megatron.trainer.MegatronTrainer.export_hf`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles.training.rng import load_rng_state, save_rng_state

__all__ = [
    "CRITIC_DIR",
    "STATE_FILE",
    "check_model_keys",
    "is_megatron_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
CRITIC_DIR = "critic"
"""The critic's own distributed checkpoint, inside the trainer's."""
_FORMAT = "megatron-dist-checkpointing"
_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def is_megatron_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a checkpoint written by :func:`save_checkpoint`."""
    return (Path(path) / "metadata.json").exists() and (Path(path) / STATE_FILE).exists()


def check_model_keys(model: Any, path: str) -> None:
    """Strict: the checkpoint's model tensors are ``model``'s (a ``GPTModel``), with the same global shapes.

    Raises ``KeyError`` naming the first missing or
    unexpected key, ``ValueError`` naming the first tensor whose shape differs (another model's config).
    The optimizer's entries (``optimizer.*``) of a trainer checkpoint are not model tensors.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from miles_megatron.checkpoint_safety import check_checkpoint_files

    check_checkpoint_files(path)
    model_sd = model.sharded_state_dict()  # its own copy: the factories (fused gate/up) are applied here
    apply_factories(model_sd)
    saved = {
        k: tuple(v.global_shape)
        for k, v in dist_checkpointing.load_tensors_metadata(path).items()
        if not k.startswith("optimizer.")
    }
    wanted = {v.key: tuple(v.global_shape) for v in nested_values(model_sd) if isinstance(v, ShardedTensor)}
    missing, unexpected = sorted(wanted.keys() - saved.keys()), sorted(saved.keys() - wanted.keys())
    if missing:
        raise KeyError(
            f"{path}: checkpoint does not match the model: missing key {missing[0]!r} ({len(missing)} missing)"
        )
    if unexpected:
        raise KeyError(
            f"{path}: checkpoint does not match the model: unexpected key {unexpected[0]!r} "
            f"({len(unexpected)} unexpected)"
        )
    for key in sorted(wanted):
        if wanted[key] != saved[key]:
            raise ValueError(
                f"{path}: checkpoint does not match the model: {key!r} has shape {list(saved[key])} in the "
                f"checkpoint, {list(wanted[key])} in the model (built from another config?)"
            )


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _init_optimizer_state(optimizer: Any) -> None:
    """Create the (zero) AdamW state of a fresh optimizer, so that its sharded state dict has the shape
    of the saved one (Megatron's distributed optimizer does not do it itself before a load)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param]["step"] = torch.zeros((), dtype=torch.float32)
                    inner.state[param]["exp_avg"] = torch.zeros_like(param.data)
                    inner.state[param]["exp_avg_sq"] = torch.zeros_like(param.data)


def _restore_steps(optimizer: Any, step: int) -> None:
    """Set every parameter's AdamW ``step`` to the optimizer steps taken, each its own tensor.

    Megatron 0.16's distributed optimizer (without TE / Apex) does not bring torch AdamW's per-parameter
    step back from a checkpoint (it comes back as 0, so the bias correction restarts), and where it sets
    one it assigns a single tensor to all parameters, which torch increments once per parameter.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param_state in opt.optimizer.state.values():
            if "exp_avg" in param_state:
                param_state["step"] = torch.tensor(float(step), dtype=torch.float32)


def _sharded(module: Any, optimizer: Any, *, is_loading: bool) -> dict[str, Any]:
    if is_loading:
        _init_optimizer_state(optimizer)
    from miles_megatron.modules import unwrap

    model_sd = unwrap(module).sharded_state_dict()
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_METADATA)
    return {"model": model_sd, "optimizer": optim_sd}


def save_checkpoint(
    path: str,
    module: Any,
    optimizer: Any,
    *,
    step: int,
    rank: int,
    critic: tuple[Any, Any] | None = None,
    critic_step: int = 0,
) -> None:
    """Save model + optimizer (sharded), step and this rank's RNG states to ``path`` (every rank calls);
    the critic's model + optimizer, when given, to ``path/critic`` (its own distributed checkpoint: its
    tensors have the policy's names)."""
    from megatron.core import dist_checkpointing

    out = Path(path)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / STATE_FILE).unlink(missing_ok=True)
    _barrier()
    dist_checkpointing.save(_sharded(module, optimizer, is_loading=False), str(out))
    if critic is not None:
        if rank == 0:
            (out / CRITIC_DIR).mkdir(exist_ok=True)
        _barrier()
        dist_checkpointing.save(_sharded(*critic, is_loading=False), str(out / CRITIC_DIR))
    save_rng_state(out, rank)
    _barrier()
    if rank == 0:
        state = {"step": step, "critic_step": critic_step, "critic": critic is not None, "format": _FORMAT}
        (out / STATE_FILE).write_text(json.dumps(state, indent=2))
    _barrier()
    log.info("saved a Megatron checkpoint of step %d to %s%s", step, out, " (with the critic)" if critic else "")


def _load_trained(src: Path, module: Any, optimizer: Any, step: int) -> None:
    from megatron.core import dist_checkpointing

    from miles_megatron.checkpoint_safety import check_checkpoint_files
    from miles_megatron.modules import unwrap

    check_checkpoint_files(src)
    state = dist_checkpointing.load(_sharded(module, optimizer, is_loading=True), str(src))
    unwrap(module).load_state_dict(state["model"])
    with torch.no_grad():
        optimizer.load_state_dict(state["optimizer"])
    _restore_steps(optimizer, step)


def load_checkpoint(
    path: str, module: Any, optimizer: Any, *, rank: int, critic: tuple[Any, Any] | None = None
) -> tuple[int, int]:
    """Restore what :func:`save_checkpoint` wrote; returns ``(step, critic_step)``."""
    from megatron.core import dist_checkpointing

    from miles_megatron.modules import unwrap

    src = Path(path)
    meta = json.loads((src / STATE_FILE).read_text())
    if meta.get("model_only"):  # converted from HF: weights only, resharded to this layout
        check_model_keys(unwrap(module), str(src))
        model_sd = unwrap(module).sharded_state_dict()
        state = dist_checkpointing.load({"model": model_sd}, str(src))
        unwrap(module).load_state_dict(state["model"])
        _barrier()
        return 0, 0
    if critic is not None and not meta.get("critic"):
        raise ValueError(f"{src}: the checkpoint has no critic (saved by a run whose algorithm needed no values)")
    step, critic_step = int(meta["step"]), int(meta.get("critic_step", 0))
    _load_trained(src, module, optimizer, step)
    if critic is not None:
        _load_trained(src / CRITIC_DIR, *critic, critic_step)
    load_rng_state(src, rank)
    _barrier()
    return step, critic_step
