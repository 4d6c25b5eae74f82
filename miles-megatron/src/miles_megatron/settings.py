"""Settings of the ``megatron`` trainer backend (``[train.backend]``) and the checks of the parallel layout.

The layout checks need the world size and the model's config, so they are a function the settings pass
calls (:func:`check_parallel_layout`, reached through :meth:`MegatronTrainer.check_settings
<miles_megatron.trainer.MegatronTrainer.check_settings>`), before any process starts; the trainer runs the
same check again on each rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from miles.components import ComponentSettings
from miles.errors import SettingsError

__all__ = ["MegatronSettings", "check_parallel_layout", "read_hf_config"]

_FIELD = "train.backend"


class MegatronSettings(ComponentSettings):
    """Options of the Megatron-Core trainer (``[train.backend] name = "megatron"``).

    Data parallel is what is left: ``cluster.trainer_ranks / (tensor_parallel x pipeline_parallel)``.
    """

    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel size: each layer's matrices split over this many ranks (must divide the attention
    heads and the key/value heads)."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline-parallel size: the decoder layers split into this many stages (must divide the layers);
    micro-batches run the 1F1B schedule."""
    expert_parallel: int = Field(1, ge=1)
    """Expert-parallel size (MoE): the experts split over this many ranks of each pipeline stage (must
    divide the experts and ``cluster.trainer_ranks / pipeline_parallel``)."""
    sequence_parallel: bool = False
    """Split norms, dropout and residuals along the sequence over the tensor-parallel ranks (needs
    ``tensor_parallel > 1``)."""
    recompute: Literal["none", "full", "selective"] = "none"
    """Activation recompute: ``full`` recomputes each layer in the backward pass, ``selective`` only the
    attention core."""
    distributed_optimizer: bool = True
    """Shard the AdamW state (and the fp32 master weights) over the data-parallel ranks (ZeRO-1)."""
    value_head_init_std: float = Field(0.0, ge=0.0)
    """PPO critic: standard deviation of the value head's initial weights (0: start from zero values)."""
    critic_lr: float | None = Field(None, gt=0.0)
    """PPO critic: peak learning rate of the value model's own AdamW (``None``: ``train.lr``)."""


def read_hf_config(model_path: str) -> dict[str, Any] | None:
    """The ``config.json`` of a HF model directory as a dict (``None`` for a ``.gguf`` file or no file)."""
    path = Path(model_path)
    file = path / "config.json"
    if path.suffix == ".gguf" or not file.exists():
        return None
    data: dict[str, Any] = json.loads(file.read_text())
    return data


def check_parallel_layout(options: MegatronSettings, world_size: int, hf_config: dict[str, Any] | None) -> int:
    """Check that the parallel sizes fit the world and the model; return the data-parallel size.

    Raises :class:`~miles.errors.SettingsError` whose message names the field (``train.backend.tensor_parallel`` ...).
    """
    tp, pp, ep = options.tensor_parallel, options.pipeline_parallel, options.expert_parallel
    if world_size % (tp * pp):
        raise SettingsError(
            f"{_FIELD}.tensor_parallel x {_FIELD}.pipeline_parallel = {tp} x {pp} = {tp * pp} does not divide "
            f"cluster.trainer_ranks = {world_size}"
        )
    if (world_size // pp) % ep:
        raise SettingsError(
            f"{_FIELD}.expert_parallel = {ep} does not divide cluster.trainer_ranks / pipeline_parallel = "
            f"{world_size // pp}"
        )
    if ep > 1 and tp > 1:
        raise SettingsError(
            f"{_FIELD}.expert_parallel = {ep} with {_FIELD}.tensor_parallel = {tp}: expert parallel together with "
            "tensor parallel is not supported yet (use one of them for MoE models)"
        )
    if options.sequence_parallel and tp == 1:
        raise SettingsError(f"{_FIELD}.sequence_parallel needs {_FIELD}.tensor_parallel > 1")
    if hf_config is not None:
        from miles_megatron.bridge import check_model_type

        check_model_type(str(hf_config.get("model_type")), vision="vision_config" in hf_config)
        heads = int(hf_config["num_attention_heads"])
        kv_heads = int(hf_config.get("num_key_value_heads") or heads)
        layers = int(hf_config["num_hidden_layers"])
        if heads % tp or kv_heads % tp:
            raise SettingsError(
                f"{_FIELD}.tensor_parallel = {tp} does not divide the model's attention heads "
                f"(num_attention_heads = {heads}, num_key_value_heads = {kv_heads})"
            )
        if layers % pp:
            raise SettingsError(
                f"{_FIELD}.pipeline_parallel = {pp} does not divide the model's layers (num_hidden_layers = {layers})"
            )
        experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
        if ep > 1 and not experts:
            raise SettingsError(f"{_FIELD}.expert_parallel = {ep} needs a mixture-of-experts model (no num_experts)")
        if experts and int(experts) % ep:
            raise SettingsError(
                f"{_FIELD}.expert_parallel = {ep} does not divide the model's experts (num_experts = {experts})"
            )
    return world_size // (tp * pp)
