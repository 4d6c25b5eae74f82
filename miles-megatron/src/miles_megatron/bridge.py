"""Megatron-Core ``GPTModel`` from a Hugging Face config, and HF <-> Megatron weights, through mbridge.

mbridge 0.15.1 knows the HF names and the fused layouts (QKV, gate/up) of each family; three shims
(each switchable off by name with ``MILES_MEGATRON_DISABLE_PATCHES``, like the CPU patches) make it work
without TransformerEngine and with transformers 5:

- ``mbridge_local_spec``: its ``AutoBridge`` hard-codes the TransformerEngine layer spec (``NameError:
  TENorm`` without TE): use Megatron's local spec when TE is not importable (always on CPU);
- ``mbridge_local_names``: its name map lacks the local spec's separate norms (``input_layernorm``,
  ``pre_mlp_layernorm``) and the ``SequentialMLP`` expert names (``local_experts.<i>``);
- ``mbridge_rope_theta``: it reads ``config.rope_theta``, which transformers 5 moved into
  ``rope_parameters``.

Everything is built through a per-model subclass of the family's bridge: nothing in mbridge is patched.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from miles.errors import SettingsError
from miles_megatron.cpu_patches import SHIMS, disabled_patches

__all__ = ["SHIMS", "SUPPORTED_MODEL_TYPES", "build_bridge", "check_model_type", "rope_theta", "te_available"]

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
"""HF ``model_type`` values the megatron trainer builds (the families the local engine serves)."""

"""Names of the mbridge shims (switchable off like the CPU patches)."""

_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


VISION_REFUSAL = (
    "the megatron trainer does not train vision-language models: mbridge 0.15.1 has no Qwen2-VL bridge, and its "
    "Qwen2.5-VL bridge builds the vision tower and projector only from TransformerEngine layers "
    "(TEColumnParallelLinear, the TE ViT layer spec), which a CPU (or a GPU without TransformerEngine) cannot "
    'build; train it with train.backend.name = "fsdp"'
)
"""Why a vision-language ``train.model_path`` is refused (checked against mbridge 0.15.1's sources)."""


def check_model_type(model_type: str, *, vision: bool = False) -> None:
    """Raise :class:`~miles.errors.SettingsError` naming ``model_type`` and the supported list when the family is
    not supported, or saying why when the model is a vision-language one (``vision``: its config has a
    ``vision_config``)."""
    if vision:
        raise SettingsError(f"train.model_path: model_type {model_type!r} is a vision-language model; {VISION_REFUSAL}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SettingsError(
            f"train.model_path: model_type {model_type!r} is not supported by the megatron trainer; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def te_available() -> bool:
    """Whether TransformerEngine imports (never on CPU-only installs)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def rope_theta(hf_config: Any) -> float:
    """The RoPE base of a HF config (transformers 5 keeps it in ``rope_parameters``); only default RoPE."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    if rope_type not in ("default", None):
        raise SettingsError(f"train.model_path: rope_type {rope_type!r} is not supported by the megatron trainer")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        raise SettingsError("train.model_path: the config has no rope_theta")
    return float(theta)


def _enabled(name: str) -> bool:
    return name not in disabled_patches()


def _shim_methods(use_te: bool) -> dict[str, Any]:
    """The overrides of the family bridge class, one group per enabled shim."""
    from mbridge.core.bridge import Bridge as base

    methods: dict[str, Any] = {}
    if _enabled("mbridge_local_spec") and not use_te:

        def _get_transformer_layer_spec(self: Any, vp_stage: int | None = None) -> Any:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            self.has_vp_stage = True
            return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)

        methods["_get_transformer_layer_spec"] = _get_transformer_layer_spec

    if _enabled("mbridge_local_names"):

        def _weight_name_mapping_mcore_local_to_global(self: Any, model: Any, consider_ep: bool = True) -> Any:
            # SequentialMLP's "local_experts.<i>.linear_fc1.weight" -> the grouped "linear_fc1.weight<i>"
            # that mbridge maps, with the global expert id when consider_ep (as mbridge does)
            names = base._weight_name_mapping_mcore_local_to_global(self, model, consider_ep=consider_ep)
            per_rank = (self.config.num_moe_experts or 0) // max(self.mpu.ep_size, 1)
            offset = per_rank * self.mpu.ep_rank if consider_ep else 0
            for local, global_name in names.items():
                match = _LOCAL_EXPERT.search(global_name)
                if match:
                    expert = int(match.group(1)) + offset
                    names[local] = _LOCAL_EXPERT.sub(f".mlp.experts.{match.group(2)}.weight{expert}", global_name)
            return names

        def _weight_name_mapping_mcore_to_hf(self: Any, name: str) -> list[str]:
            layer = name.split(".")[2] if name.startswith("decoder.layers.") else ""
            if name.endswith(".input_layernorm.weight"):
                return [f"model.layers.{layer}.input_layernorm.weight"]
            if name.endswith(".pre_mlp_layernorm.weight"):
                return [f"model.layers.{layer}.post_attention_layernorm.weight"]
            return list(base._weight_name_mapping_mcore_to_hf(self, name))

        def _weight_split_across_tp(self: Any, name: str, weights: Any, param: Any, size: int) -> Any:
            # experts are not split over TP (expert_tensor_parallel = 1): every TP rank holds them whole
            if ".mlp.experts.local_experts." in name:
                return [weights] * size
            return base._weight_split_across_tp(self, name, weights, param, size)

        def _weight_merge_across_tp(self: Any, name: str, weights: list[Any], param: Any) -> Any:
            if "mlp.experts.linear_fc" in name and self.mpu.etp_size == 1:
                return weights[0]
            return base._weight_merge_across_tp(self, name, weights, param)

        methods["_weight_split_across_tp"] = _weight_split_across_tp
        methods["_weight_merge_across_tp"] = _weight_merge_across_tp
        methods["_weight_name_mapping_mcore_local_to_global"] = _weight_name_mapping_mcore_local_to_global
        methods["_weight_name_mapping_mcore_to_hf"] = _weight_name_mapping_mcore_to_hf

    if _enabled("mbridge_rope_theta"):

        def _get_gptmodel_args(self: Any) -> dict[str, Any]:
            return dict(
                vocab_size=self.hf_config.vocab_size,
                max_sequence_length=self.hf_config.max_position_embeddings,
                position_embedding_type="rope",
                rotary_base=rope_theta(self.hf_config),
            )

        methods["_get_gptmodel_args"] = _get_gptmodel_args
    return methods


def _config_overrides(hf_config: Any, *, te: bool, dtype: torch.dtype, options: Any) -> dict[str, Any]:
    """TransformerConfig fields set on top of mbridge's: fusions off without TransformerEngine (``te``:
    its layer spec is built; never on CPU), our parallel settings."""
    overrides: dict[str, Any] = dict(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=False,
        sequence_parallel=bool(options.sequence_parallel),
        use_cpu_initialization=True,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_shared_expert_overlap=False,
        variable_seq_lengths=True,
    )
    if not te:
        overrides.update(
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            gradient_accumulation_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
        )
    if options.recompute != "none":
        overrides.update(recompute_granularity=options.recompute)
        if options.recompute == "full":
            overrides.update(recompute_method="uniform", recompute_num_layers=1)
    model_type = hf_config.model_type
    if model_type in ("qwen2_moe", "qwen3_moe"):
        overrides["moe_enable_routing_replay"] = True  # the routers' hook for R3 (miles_megatron.routing)
        # HF renormalises the top-k weights with norm_topk_prob: softmax over the top-k logits is the same
        overrides["moe_router_pre_softmax"] = not bool(getattr(hf_config, "norm_topk_prob", False))
    if model_type == "qwen2_moe":
        overrides["moe_shared_expert_gate"] = True
    return overrides


def build_bridge(
    hf_config: Any,
    *,
    cpu: bool,
    dtype: torch.dtype,
    options: Any,
    vocab_divisor: int | None,
    local_spec: bool = False,
) -> Any:
    """The family's mbridge bridge (with the shims) for the current ``parallel_state``.

    :param options: the trainer's :class:`~miles_megatron.settings.MegatronSettings` (sequence parallel,
        recompute).
    :param vocab_divisor: pad the vocabulary to a multiple of this (TP needs it divisible), or ``None``.
    :param local_spec: build Megatron's local layer spec even where TransformerEngine is installed (LoRA
        adapts the local spec's parallel linears).
    """
    check_model_type(hf_config.model_type, vision=getattr(hf_config, "vision_config", None) is not None)
    import mbridge  # noqa: F401  (registers the families)
    from mbridge.core.bridge import _MODEL_REGISTRY

    use_te = te_available() and not cpu and not local_spec
    if not te_available() and _enabled("moe_te_names"):
        # Megatron's MoE router reads names that moe_utils defines only when TransformerEngine imports
        # (``te_general_gemm``): without TransformerEngine they are absent on GPU as on CPU
        from miles_megatron.cpu_patches import fill_moe_te_names

        fill_moe_te_names()
    family = _MODEL_REGISTRY[hf_config.model_type]
    methods = _shim_methods(use_te)
    # a fresh name map per model: mbridge edits it in place for tied embeddings
    methods["_DIRECT_MAPPING"] = {**family._DIRECT_MAPPING, "output_layer.weight": "lm_head.weight"}
    if getattr(hf_config, "tie_word_embeddings", False):
        methods["_DIRECT_MAPPING"]["output_layer.weight"] = "model.embed_tokens.weight"
    cls = type(f"Miles{family.__name__}", (family,), methods)
    bridge = cls(hf_config, dtype=dtype, make_vocab_size_divisible_by=vocab_divisor)
    bridge.set_extra_args(**_config_overrides(hf_config, te=use_te, dtype=dtype, options=options))
    return bridge
