"""The ``python -m sglang.launch_server`` command line of one engine, from the run's settings.

Every flag Miles writes is one of SGLang's own (``ServerArgs`` fields, ``--flag-name`` spelling); the
``sglang-protocol`` tox env checks them against the pinned SGLang's source, so a renamed flag fails CI.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.errors import SettingsError
from miles.rollout.protocol import LAUNCH_WEIGHT_VERSION
from miles_sglang.settings import SGLangEngineSettings

if TYPE_CHECKING:
    from miles.training.adapter import LowRankSpec

__all__ = ["CPU_ENV", "ENGINE_ENV", "EnginePlacement", "launch_argv", "lora_argv"]

CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
"""The environment in which SGLang takes its CPU path (``sglang.srt.utils.is_cpu``; ``--device cpu`` alone
leaves it on its CUDA defaults)."""

ENGINE_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
"""The environment of every SGLang engine Miles starts. SGLang 0.5.23's ``/health`` otherwise generates a token
and answers only once its detokenizer says something (503 after 20 s): a paused engine (every weight push in
the async modes), or one whose queue is long on busy cores, looked dead to Miles' failover (``/health``, 10 s)
and to smg's health checks. With it, ``/health`` says the server process answers; ``/health_generate`` still
generates (the launcher waits on it at start)."""


@dataclass(frozen=True)
class EnginePlacement:
    """Where one engine runs and what the run tells it."""

    model_path: str
    host: str
    port: int
    base_gpu_id: int | None
    """First GPU of the engine, as its process numbers them (the launcher's placement: host-wide with the
    ``local`` launcher, 0 with ``ray``, whose actors see only their own GPUs); ``None`` on a CPU."""
    seed: int
    """``train.seed + rank``: engines sample differently, reproducibly."""
    dtype: str
    """The dtype engines serve (``float32``, ``bfloat16`` ...; ``auto``: the checkpoint's)."""
    memory_saver: bool
    """``--enable-memory-saver`` (colocated runs release weights and KV cache while the trainer trains)."""
    device: str = "cuda"
    """``cuda``, or ``cpu``: SGLang's CPU backend (``--device cpu``, no overlap scheduling; the launch
    environment sets ``SGLANG_USE_CPU_ENGINE=1``, :data:`CPU_ENV`)."""

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"


def lora_argv(settings: SGLangEngineSettings, adapter: LowRankSpec | None, *, device: str = "cuda") -> list[str]:
    """SGLang's LoRA flags for an engine that serves the run's ``adapter`` (``None``: the run trains none).
    On a CPU (``device = "cpu"``) the LoRA kernels default to ``torch_native``: SGLang's default (``csgmv``)
    and its other backends are Triton kernels for GPUs.

    Adapters are loaded at run time, so SGLang needs the largest rank and the target projections up front
    (``--max-lora-rank``, ``--lora-target-modules``): taken from ``adapter`` unless set. Raises
    :class:`~miles.errors.SettingsError` naming the field that cannot serve the adapter.
    """
    enabled = settings.enable_lora if settings.enable_lora is not None else adapter is not None
    if not enabled:
        if adapter is not None:
            raise SettingsError("rollout.engine.enable_lora = false: the run trains a LoRA adapter (train.adapter)")
        return []
    rank = settings.max_lora_rank or (adapter.r if adapter is not None else None)
    targets = settings.lora_target_modules or (list(adapter.target_modules) if adapter is not None else None)
    if rank is None or not targets:
        raise SettingsError(
            "rollout.engine.enable_lora: SGLang needs rollout.engine.max_lora_rank and lora_target_modules "
            "(or a train.adapter to take them from)"
        )
    if adapter is not None:
        if rank < adapter.r:
            raise SettingsError(f"rollout.engine.max_lora_rank = {rank} is below train.adapter.r = {adapter.r}")
        missing = [t for t in adapter.target_modules if t not in targets and "all" not in targets]
        if missing:
            raise SettingsError(
                f"rollout.engine.lora_target_modules lacks {', '.join(missing)} (in train.adapter.target_modules)"
            )
    argv = ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *targets]
    if settings.max_loras_per_batch is not None:
        argv += ["--max-loras-per-batch", str(settings.max_loras_per_batch)]
    if settings.max_loaded_loras is not None:
        argv += ["--max-loaded-loras", str(settings.max_loaded_loras)]
    backend = settings.lora_backend or ("torch_native" if device == "cpu" else None)
    if backend is not None:
        argv += ["--lora-backend", backend]
    return argv


def launch_argv(
    settings: SGLangEngineSettings, where: EnginePlacement, adapter: LowRankSpec | None = None
) -> list[str]:
    """The command that starts one SGLang server (``argv[0]`` is this Python); ``adapter``: the run's LoRA
    adapter (:func:`lora_argv`).

    On a CPU (``where.device == "cpu"``): ``--device cpu`` instead of ``--base-gpu-id`` (SGLang reads the GPU
    id as the NUMA node to bind its threads to) and ``--disable-overlap-schedule`` (overlap scheduling runs
    on CUDA streams)."""
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", where.model_path,
        "--host", where.host,
        "--port", str(where.port),
        "--tp-size", str(settings.tp_size),
    ]  # fmt: skip
    if where.on_cpu:
        argv += ["--device", "cpu"]
    else:
        if where.base_gpu_id is None:
            raise SettingsError("rollout.engine: an SGLang engine on CUDA needs its first GPU (base_gpu_id)")
        argv += ["--base-gpu-id", str(where.base_gpu_id)]
    argv += [
        "--random-seed", str(where.seed),
        "--dtype", where.dtype,
        "--weight-version", LAUNCH_WEIGHT_VERSION,
    ]  # fmt: skip
    if settings.max_total_tokens is not None:
        argv += ["--max-total-tokens", str(settings.max_total_tokens)]
    if settings.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(settings.mem_fraction_static)]
    if settings.context_length is not None:
        argv += ["--context-length", str(settings.context_length)]
    if settings.max_running_requests is not None:
        argv += ["--max-running-requests", str(settings.max_running_requests)]
    if settings.attention_backend is not None:
        argv += ["--attention-backend", settings.attention_backend]
    if settings.log_level is not None:
        argv += ["--log-level", settings.log_level]
    switches = {
        "--enable-return-routed-experts": settings.enable_return_routed_experts,
        "--enable-deterministic-inference": settings.enable_deterministic_inference,
        "--enable-memory-saver": where.memory_saver,
        "--skip-server-warmup": settings.skip_server_warmup,
        "--disable-overlap-schedule": where.on_cpu,
    }
    argv += [flag for flag, on in switches.items() if on]
    argv += lora_argv(settings, adapter, device=where.device)
    return argv + list(settings.extra_args)
