"""The Megatron side of a run: parallel state, the ``GPTModel`` built from a HF config, Megatron DDP and
the Megatron optimizer.

On CPU the process-wide patches of :mod:`miles_megatron.cpu_patches` are applied first (only there).
Gradients are *summed* over data-parallel ranks (``calculate_per_token_loss``: no 1/DP scaling) because
the loss is already divided by step-wide counts, exactly as in miles-fsdp.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles.errors import SettingsError
from miles_megatron.modules import unwrap
from miles_megatron.settings import MegatronSettings

if TYPE_CHECKING:
    from miles.training.routing import RouterReplay

__all__ = [
    "ModelParts",
    "build_model",
    "build_optimizer",
    "init_parallel",
    "load_hf_config",
    "unwrap",
    "wrap_for_training",
]

log = logging.getLogger(__name__)


def load_hf_config(model_path: str) -> Any:
    """The HF config of ``model_path`` (a directory; ``.gguf`` files are not supported by this trainer)."""
    from transformers import AutoConfig

    path = Path(model_path)
    if path.suffix == ".gguf":
        raise SettingsError(
            f"train.model_path: {model_path!r} is a .gguf file; the megatron trainer needs a HF safetensors "
            "directory (convert it first: miles convert gguf FILE OUT)"
        )
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"train.model_path: {model_path!r} is not a directory with config.json")
    return AutoConfig.from_pretrained(path)


def init_parallel(options: MegatronSettings, *, device: str, seed: int) -> None:
    """Apply the CPU patches (CPU only) and initialise Megatron's parallel state on the current world."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    from miles_megatron.cpu_patches import apply_cpu_patches

    apply_cpu_patches(device)
    layout = (options.tensor_parallel, options.pipeline_parallel, options.expert_parallel)
    if mpu.model_parallel_is_initialized():
        current = (
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_pipeline_model_parallel_world_size(),
            mpu.get_expert_model_parallel_world_size(),
        )
        if current == layout:
            return
        mpu.destroy_model_parallel()
        tensor_parallel.get_cuda_rng_tracker().reset()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=options.tensor_parallel,
        pipeline_model_parallel_size=options.pipeline_parallel,
        expert_model_parallel_size=options.expert_parallel,
        expert_tensor_parallel_size=1,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


@dataclass
class ModelParts:
    """One model on this rank: the (DDP-wrapped when trainable) module and its bridge."""

    module: Any
    bridge: Any
    vocab_size: int
    """The HF vocabulary (logits beyond it are TP padding)."""
    routing: RouterReplay | None = None
    """The MoE routers' replay and agreement counts (the actor of an MoE model; :mod:`miles_megatron.routing`)."""


def build_model(
    hf_config: Any,
    options: MegatronSettings,
    *,
    device: str,
    dtype: torch.dtype,
    weights: str | None,
    trainable: bool,
    prepare: Callable[[Any, Any], None] | None = None,
    local_spec: bool = False,
) -> ModelParts:
    """This rank's stage of the ``GPTModel`` (its TP / EP shards), HF weights loaded from ``weights``.

    ``prepare(model, bridge)`` runs after the weights are loaded and before the DDP wrap (the critic swaps
    its output layer there, LoRA adds its adapters). A trainable model is wrapped in Megatron DDP (gradient
    buffers for its trainable parameters, summed over data parallel); a frozen one (the reference) is not.
    ``local_spec``: Megatron's local layer spec even where TransformerEngine is installed.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    from miles_megatron.bridge import build_bridge

    tp = options.tensor_parallel
    divisor = tp if hf_config.vocab_size % tp else None
    bridge = build_bridge(
        hf_config, cpu=device == "cpu", dtype=dtype, options=options, vocab_divisor=divisor, local_spec=local_spec
    )
    bridge.set_extra_args(calculate_per_token_loss=True)
    provider = bridge._model_provider([])
    model = provider(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if device == "cuda":
        model.cuda(torch.cuda.current_device())
    if weights is not None:
        from miles_megatron.weights import check_hf_keys

        check_hf_keys(bridge, model, weights)
        with torch.no_grad():
            bridge.load_weights([model], weights)
    if prepare is not None:
        prepare(model, bridge)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
        return ModelParts(model, bridge, int(hf_config.vocab_size))
    return ModelParts(wrap_for_training(model, options), bridge, int(hf_config.vocab_size))


def wrap_for_training(model: Any, options: MegatronSettings) -> Any:
    """``model`` in Megatron DDP: contiguous gradient buffers in fp32, summed over data parallel, sharded
    for the distributed optimizer when asked."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=options.distributed_optimizer,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(module: Any, train: Any, options: MegatronSettings, *, dtype: torch.dtype) -> Any:
    """Megatron's AdamW (distributed over DP when asked) with gradient clipping; weight decay on every
    parameter, as miles-fsdp's AdamW (Megatron's default skips biases and norms)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=train.lr,
        min_lr=train.min_lr,
        weight_decay=train.weight_decay,
        adam_beta1=float(train.adam_betas[0]),
        adam_beta2=float(train.adam_betas[1]),
        adam_eps=train.adam_eps,
        clip_grad=train.grad_clip,
        bf16=dtype is torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=options.distributed_optimizer,
    )
    return get_megatron_optimizer(config, [module], config_overrides={})
