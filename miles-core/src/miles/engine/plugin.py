"""The ``local`` rollout-engine backend: starts ``miles serve`` (built-in plugin ``local_engine``).

Imports cheaply: nothing here touches torch.
"""

from __future__ import annotations

import sys
from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from miles.components import ComponentSettings
from miles.plugins.manager import hookimpl
from miles.plugins.registry import Register
from miles.rollout.engine import EngineCapabilities, EngineLaunch, RolloutEngine

__all__ = ["LocalEngine", "LocalEngineSettings"]


class LocalEngineSettings(ComponentSettings):
    """Settings of the local engine (``rollout.engine = {name = "local", ...}``)."""

    max_cache_tokens: int = Field(1 << 16, ge=0)
    """Prefix-cache capacity in tokens (LRU eviction beyond it; 0 disables the cache)."""
    max_kv_tokens: int | None = Field(None, ge=1)
    """KV positions the running batch may hold (default: what fits in 4 GiB); requests wait beyond it."""
    max_running_requests: int = Field(64, ge=1)
    """Requests decoded together at most; more wait in the queue."""
    context_length: int | None = Field(None, ge=2)
    """Longest prompt + output (default: the model's ``max_position_embeddings``)."""
    threads: int | None = Field(None, ge=1)
    """torch intra-op threads of the engine process (default: torch's choice)."""
    api_key: str | None = None
    """Require ``Authorization: Bearer <key>`` on every route."""
    return_original_logprob: bool = False
    """Report logprobs of the raw logits (before temperature) by default, as ``SGLANG_RETURN_ORIGINAL_LOGPROB``."""
    enable_deterministic_inference: bool = False
    """Batch-invariant inference (SGLang's ``--enable-deterministic-inference``): every request is prefilled
    and decoded on its own and the prefix cache hits whole prompts only, so tokens and logprobs do not
    depend on batching, timing or the cache's contents — a resumed run reproduces the engine's logprobs bit
    for bit. Slower: decode runs one request at a time."""
    attention_backend: Literal["auto", "sdpa", "miles_cpu"] = "auto"
    """Attention and fused kernels (``miles serve --attention-backend``): ``miles_cpu`` runs decode attention
    and the RMSNorm / rotary steps on Miles' CPU kernels (compiled on first use: a C++ compiler and
    ``ninja``); ``sdpa`` runs PyTorch ops only; ``auto`` takes the kernels on CPU where they build."""
    enable_debug_endpoints: bool = False
    """Serve ``/debug/*`` routes (``/debug/randomize_weights`` for ``transport.randomize_engines_first``)."""


class LocalEngine(RolloutEngine):
    """Miles' own torch engine, ``miles serve``: CPU or GPU, continuous batching, radix cache."""

    name = "local"
    Settings: ClassVar[type[BaseModel]] = LocalEngineSettings
    capabilities = EngineCapabilities(update_weights_from_disk=True, routed_experts=True)

    def launch(
        self, *, model_path: str, host: str, port: int, device: str, dtype: str, devices: list[int]
    ) -> EngineLaunch:
        s = self.settings
        argv = [
            sys.executable, "-m", "miles.engine",
            "--model", model_path, "--host", host, "--port", str(port), "--device", device,
            "--dtype", "auto" if dtype in ("", "auto") else dtype,
        ]  # fmt: skip
        cache = getattr(s, "max_cache_tokens", None)
        if cache is not None:
            argv += ["--max-cache-tokens", str(cache)]
        for flag, attr in (
            ("--max-running-requests", "max_running_requests"),
            ("--context-length", "context_length"),
            ("--max-kv-tokens", "max_kv_tokens"),
            ("--threads", "threads"),
            ("--api-key", "api_key"),
        ):
            value = getattr(s, attr, None)
            if value is not None:
                argv += [flag, str(value)]
        if getattr(s, "return_original_logprob", False):
            argv.append("--return-original-logprob")
        if getattr(s, "enable_deterministic_inference", False):
            argv.append("--enable-deterministic-inference")
        backend = getattr(s, "attention_backend", "auto")
        if backend != "auto":
            argv += ["--attention-backend", backend]
        if getattr(s, "enable_debug_endpoints", False):
            argv.append("--enable-debug-endpoints")
        env = {}
        if device == "cuda" and devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
        return EngineLaunch(argv=argv, url=f"http://{host}:{port}", env=env)


@hookimpl
def miles_register_rollout_engines(register: Register) -> None:
    register(LocalEngine)
