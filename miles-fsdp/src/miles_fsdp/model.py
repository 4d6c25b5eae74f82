"""Load a Hugging Face causal LM (or its critic) and shard it with FSDP2 (``fully_shard``).

Every rank materialises the model on the CPU from the same checkpoint (or from the same seed when the
directory holds only a ``config.json``), then ``fully_shard`` is applied per decoder layer and to the root,
which moves each rank's shard to the device of the mesh.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "ValueModel",
    "decoder_layers",
    "enable_activation_checkpointing",
    "load_causal_lm",
    "load_value_model",
    "shard_model",
]

log = logging.getLogger(__name__)

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _has_weights(path: Path) -> bool:
    return any((path / f).exists() for f in _WEIGHT_FILES)


def load_config(model_path: str) -> PretrainedConfig:
    """The model's config; ``model_path`` is a HF directory or a ``.gguf`` file."""
    from transformers import AutoConfig

    path = Path(model_path)
    if path.suffix == ".gguf":
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"train.model_path: {model_path!r} is neither a .gguf file nor a directory with config.json"
        )
    return AutoConfig.from_pretrained(path)


def load_causal_lm(model_path: str, *, seed: int, attn_implementation: str) -> PreTrainedModel:
    """An fp32 ``AutoModelForCausalLM`` (``AutoModelForImageTextToText`` for a vision-language model) on the CPU.

    A directory with weights (safetensors) loads them; a directory with only ``config.json`` builds the
    model from the config with ``seed`` (identical on every rank); a ``.gguf`` file is dequantised.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = Path(model_path)
    if path.suffix != ".gguf" and getattr(load_config(model_path), "vision_config", None) is not None:
        auto: Any = AutoModelForImageTextToText  # a vision-language model: its vision tower too
        if _has_weights(path):
            return auto.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
        torch.manual_seed(seed)
        return auto.from_config(load_config(model_path), dtype=torch.float32, attn_implementation=attn_implementation)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation=attn_implementation
        )
    config = load_config(model_path)
    if _has_weights(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    log.info("%s holds no weights: building the model from its config with seed %d", path, seed)
    torch.manual_seed(seed)
    config._attn_implementation = attn_implementation
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class ValueModel(nn.Module):
    """PPO critic: the policy's decoder backbone with a scalar head on each position's last hidden state."""

    def __init__(self, backbone: nn.Module, hidden_size: int, init_std: float) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1, bias=False)
        if init_std > 0:
            nn.init.normal_(self.value_head.weight, std=init_std)
        else:
            nn.init.zeros_(self.value_head.weight)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Values per position; ``kwargs`` go to the attention (``packed_segments``)."""
        hidden = self.backbone(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs
        ).last_hidden_state
        # a fresh tensor, not a view: FSDP hooks the root's output for the backward
        return self.value_head(hidden).squeeze(-1).to(torch.float32, copy=True)


def load_value_model(model_path: str, *, seed: int, attn_implementation: str, init_std: float) -> ValueModel:
    """The critic: the causal LM's backbone (``model.model``) plus a fresh value head (seeded)."""
    lm = load_causal_lm(model_path, seed=seed, attn_implementation=attn_implementation)
    backbone = lm.get_decoder()
    backbone.config.use_cache = False
    torch.manual_seed(seed + 1)
    return ValueModel(backbone, lm.config.hidden_size, init_std)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (the classes HF lists in ``_no_split_modules``)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__} (no _no_split_modules)")
    return layers


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of each decoder layer (the model's or its ``backbone``'s)."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    target = model if enable is not None else getattr(model, "backbone", None)
    if target is None or not hasattr(target, "gradient_checkpointing_enable"):
        raise TypeError(f"{type(model).__name__} does not support activation checkpointing")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool,
    activation_checkpointing: bool,
) -> FSDPModule:
    """Apply ``fully_shard`` to every decoder layer and the root; gradients are summed over ranks.

    The trainer divides the loss by step-wide token / sequence counts, so FSDP's default division of the
    reduced gradient by the world size is switched off (divide factor 1, plain SUM reductions).
    """
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs: dict[str, object] = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    assert isinstance(model, FSDPModule)
    return model
