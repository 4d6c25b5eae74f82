"""``miles serve``: run the local rollout engine (SGLang's HTTP protocol) for a HF causal LM."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from miles.cli.app import app
from miles.errors import SettingsError


@app.command()
def serve(
    model: Annotated[Path, typer.Option("--model", help="Hugging Face model directory (config.json + safetensors).")],
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 30000,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32, bfloat16, float16 or auto (the checkpoint's).")] = "float32",
    api_key: Annotated[str | None, typer.Option(help="Require 'Authorization: Bearer KEY' on every route.")] = None,
    max_cache_tokens: Annotated[int, typer.Option(help="Prefix-cache capacity in tokens (LRU beyond; 0 = off).")] = 1
    << 16,
    max_kv_tokens: Annotated[
        int | None, typer.Option(help="KV positions of the running batch (default: 4 GiB worth); requests wait beyond.")
    ] = None,
    max_running_requests: Annotated[int, typer.Option(help="Requests decoded together at most.")] = 64,
    context_length: Annotated[int | None, typer.Option(help="Longest prompt + output (default: the model's).")] = None,
    threads: Annotated[int | None, typer.Option(help="torch intra-op threads.")] = None,
    weight_version: Annotated[str, typer.Option(help="Initial weight version reported by /model_info.")] = "0",
    return_original_logprob: Annotated[
        bool, typer.Option(help="Report raw-logit logprobs (before temperature) by default.")
    ] = False,
    enable_deterministic_inference: Annotated[
        bool,
        typer.Option(
            help="Batch-invariant forwards and an exact-match prefix cache: a request's tokens and logprobs "
            "do not depend on what else runs (slower: decode runs one request at a time)."
        ),
    ] = False,
    enable_debug_endpoints: Annotated[
        bool, typer.Option(help="Serve /debug/* routes (e.g. randomize the weights, for weight-sync tests).")
    ] = False,
    attention_backend: Annotated[
        str,
        typer.Option(
            help="miles_cpu: decode attention, RMSNorm and rotary on Miles' CPU kernels (compiled on first use); "
            "sdpa: PyTorch ops only; auto: the kernels on CPU where they build."
        ),
    ] = "auto",
) -> None:
    """Serve a model with the local engine (continuous batching, radix prefix cache, exact logprobs)."""
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise SettingsError(f"--device: expected cpu or cuda, got {device!r}")
    if dtype not in ("float32", "bfloat16", "float16", "auto"):
        raise SettingsError(f"--dtype: expected float32, bfloat16, float16 or auto, got {dtype!r}")
    from miles.engine.model_runner import ATTENTION_BACKENDS

    if attention_backend not in ATTENTION_BACKENDS:
        raise SettingsError(
            f"--attention-backend: expected one of {', '.join(ATTENTION_BACKENDS)}, got {attention_backend!r}"
        )
    if not (model / "config.json").exists():
        raise SettingsError(f"--model: {model} is not a Hugging Face model directory (no config.json)")
    from miles.engine.launch import serve as run

    run(
        model,
        host=host,
        port=port,
        threads=threads,
        device=device,
        dtype=dtype,
        api_key=api_key,
        max_cache_tokens=max_cache_tokens,
        max_kv_tokens=max_kv_tokens,
        max_running_requests=max_running_requests,
        context_length=context_length,
        weight_version=weight_version,
        return_raw_logprob=return_original_logprob,
        enable_deterministic_inference=enable_deterministic_inference,
        enable_debug_endpoints=enable_debug_endpoints,
        attention_backend=attention_backend,
    )
