"""Settings of the ``sglang`` rollout engine (``[rollout.engine] name = "sglang"``) and of the
``sglang_tensor`` transport. Each field's docstring is its documentation."""

from __future__ import annotations

from pydantic import Field

from miles.components import ComponentSettings
from miles.transport.colocated import TensorIpcTransportSettings

__all__ = ["SGLANG_VERSION", "SGLangEngineSettings", "TensorTransportSettings"]

SGLANG_VERSION = "0.5.23"
"""The SGLang release whose flags and request fields Miles is checked against (``tox -e sglang-protocol``)."""


class SGLangEngineSettings(ComponentSettings):
    """One ``python -m sglang.launch_server`` per engine; on CUDA the launcher places ``tp_size`` GPUs for
    each, with ``cluster.device = "cpu"`` it serves on the CPU (``docs/how-to/sglang-cpu.md``)."""

    tp_size: int = Field(1, ge=1)
    """Tensor-parallel size of one engine (``--tp-size``): GPUs ``base .. base + tp_size - 1`` of its host,
    ``base = rank x tp_size`` (``--base-gpu-id``)."""
    mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0)
    """Share of GPU memory for weights and KV cache (``--mem-fraction-static``; default: SGLang's choice).
    Colocated with a trainer, leave it room (0.5-0.7)."""
    max_total_tokens: int | None = Field(None, ge=1)
    """Tokens the KV cache holds, all requests together (``--max-total-tokens``; default: SGLang's choice,
    from free GPU memory or, on a CPU, from free RAM x ``mem_fraction_static``). On a CPU set it: 4096 serves
    a small model in well under 1 GB."""
    context_length: int | None = Field(None, ge=2)
    """Longest prompt + output (``--context-length``; default: the model's)."""
    max_running_requests: int | None = Field(None, ge=1)
    """Requests decoded together at most (``--max-running-requests``)."""
    enable_deterministic_inference: bool = False
    """Batch-invariant kernels (``--enable-deterministic-inference``): tokens and logprobs do not depend on
    batching, so a resumed run reproduces them."""
    enable_return_routed_experts: bool = False
    """Routing replay for MoE models: the engine returns each token's routed experts
    (``--enable-return-routed-experts``) so the trainer can replay them."""
    enable_memory_saver: bool | None = None
    """Release weights and KV cache on request (``--enable-memory-saver``, needs ``torch_memory_saver``);
    default: on when ``cluster.colocate`` is set."""
    skip_server_warmup: bool = True
    """Skip SGLang's warm-up request (``--skip-server-warmup``): the launcher waits on ``/health_generate``,
    which generates a token anyway."""
    attention_backend: str | None = None
    """SGLang's ``--attention-backend`` (``fa3``, ``flashinfer``, ``triton`` ...; default: its choice)."""
    log_level: str | None = None
    """SGLang's ``--log-level`` (``warning`` keeps engine logs short)."""
    enable_lora: bool | None = None
    """Serve LoRA adapters (``--enable-lora``; they are loaded at run time with ``/load_lora_adapter``);
    default: on when the run trains one (``train.adapter``)."""
    max_lora_rank: int | None = Field(None, ge=1)
    """Largest adapter rank served (``--max-lora-rank``); default: the run's ``train.adapter.r``."""
    lora_target_modules: list[str] | None = None
    """Projections adapters may target (``--lora-target-modules``, ``["all"]`` for every one SGLang
    supports); default: the run's ``train.adapter.target_modules``."""
    max_loras_per_batch: int | None = Field(None, ge=1)
    """Adapters in one running batch, the base model counting as one (``--max-loras-per-batch``; SGLang's
    default: 8)."""
    max_loaded_loras: int | None = Field(None, ge=1)
    """Adapters held in CPU memory at most (``--max-loaded-loras``; at least ``max_loras_per_batch``)."""
    lora_backend: str | None = None
    """SGLang's multi-LoRA kernels (``--lora-backend``: ``csgmv``, ``triton``, ``torch_native`` ...; default: its
    choice on a GPU, ``torch_native`` on a CPU, where its other backends, Triton kernels, do not run)."""
    extra_args: list[str] = Field(default_factory=list)
    """Any other ``sglang.launch_server`` flags, passed as given (``["--chunked-prefill-size", "4096"]``)."""


class TensorTransportSettings(TensorIpcTransportSettings):
    """Settings of the ``sglang_tensor`` transport (colocated engines, CUDA IPC through
    ``/update_weights_from_tensor``): those of ``tensor_ipc``."""
