"""The ``python -m sglang.launch_server`` command line of one engine, from the run's settings.

Every flag Miles writes is one of SGLang's own (``ServerArgs`` fields, ``--flag-name`` spelling); the
``sglang-protocol`` tox env checks them against the pinned SGLang's source, so a renamed flag fails CI.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from miles_sglang.settings import SGLangEngineSettings

__all__ = ["EnginePlacement", "launch_argv"]


@dataclass(frozen=True)
class EnginePlacement:
    """Where one engine runs and what the run tells it."""

    model_path: str
    host: str
    port: int
    base_gpu_id: int
    """First GPU of the engine (the launcher's placement: ``rank x tp_size``)."""
    seed: int
    """``train.seed + rank``: engines sample differently, reproducibly."""
    dtype: str
    """The dtype engines serve (``float32``, ``bfloat16`` ...; ``auto``: the checkpoint's)."""
    memory_saver: bool
    """``--enable-memory-saver`` (colocated runs release weights and KV cache while the trainer trains)."""


def launch_argv(settings: SGLangEngineSettings, where: EnginePlacement) -> list[str]:
    """The command that starts one SGLang server (``argv[0]`` is this Python)."""
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", where.model_path,
        "--host", where.host,
        "--port", str(where.port),
        "--tp-size", str(settings.tp_size),
        "--base-gpu-id", str(where.base_gpu_id),
        "--random-seed", str(where.seed),
        "--dtype", where.dtype,
        "--weight-version", "0",
    ]  # fmt: skip
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
    }
    argv += [flag for flag, on in switches.items() if on]
    return argv + list(settings.extra_args)
