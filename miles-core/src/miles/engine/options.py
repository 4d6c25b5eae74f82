"""The local engine's options: one model for the run's ``[rollout.engine]`` table, ``miles serve``'s flags,
the command line the ``local`` backend launches and what ``/server_info`` reports.

:class:`EngineOptions` holds what a run configures; :class:`ServeOptions` adds where one engine serves
(model, address, device). Flags are the field names with dashes (``--max-cache-tokens``); booleans are
switches (``--no-huge-pages`` turns off one that is on by default); help texts are the fields' docstrings.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from miles.auth import SECRET_FIELDS, ServiceKeys
from miles.components import ComponentSettings
from miles.errors import SettingsError
from miles.rollout.protocol import LAUNCH_WEIGHT_VERSION

__all__ = ["ATTENTION_BACKENDS", "SECRET_FIELDS", "EngineOptions", "ServeOptions", "parse_serve_args", "to_argv"]

ATTENTION_BACKENDS = ("auto", "sdpa", "miles_cpu")


class EngineOptions(ComponentSettings):
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
    return_original_logprob: bool = False
    """Report logprobs of the raw logits (before temperature) by default, as ``SGLANG_RETURN_ORIGINAL_LOGPROB``."""
    enable_deterministic_inference: bool = False
    """Batch-invariant inference (SGLang's ``--enable-deterministic-inference``): tokens and logprobs do not
    depend on batching, timing or the cache's contents — a resumed run reproduces the engine's logprobs bit
    for bit, and ``train.true_on_policy`` trains on them exactly. Dense float32 models on CPU compute with the
    batch-invariant ops (:mod:`miles.engine.invariant`, which the trainer's true on-policy forward shares) and
    stay batched; other models (MoE, bfloat16, GPU) are prefilled and decoded one request at a time (slower).
    The prefix cache hits whole prompts only."""
    attention_backend: Literal["auto", "sdpa", "miles_cpu"] = "auto"
    """Attention and fused kernels: ``miles_cpu`` runs decode attention and the RMSNorm / rotary steps on
    Miles' CPU kernels (compiled on first use: a C++ compiler and ``ninja``); ``sdpa`` runs PyTorch ops
    only; ``auto`` takes the kernels on CPU where they build."""
    huge_pages: bool = True
    """CPU: hold the projections and the embedding in one block on transparent huge pages
    (:mod:`miles.engine.huge_pages`) where the kernel offers them: a decode step reads every weight, and through
    2 MiB pages it reads them faster (53-55 against 29-47 GB/s on this project's AMD host). ``False``: where
    ``transformers`` put them."""
    allowed_weight_dirs: str | None = None
    """Directories (separated by ``:``) that ``/update_weights_from_disk`` and ``/update_weights_from_delta``
    may load from, besides the served model's own directory and those in the environment variable
    ``MILES_ALLOWED_WEIGHT_DIRS``; any other path is refused. ``miles train`` allows the run's directory and
    the transport's ``dir``."""
    quantization: Literal["fp8_block", "fp8_row", "fp8_tensor", "mxfp8", "nvfp4"] | None = None
    """Low-precision projection weights the engine holds and computes with (:mod:`miles.engine.quantized`);
    a run sets it from its precision recipe (``fp8``, ``mxfp8``, ``nvfp4``). Default: none."""
    enable_debug_endpoints: bool = False
    """Serve ``/debug/*`` routes (``/debug/randomize_weights`` for ``transport.randomize_engines_first``)."""


class ServeOptions(EngineOptions):
    """Everything one ``miles serve`` process needs: the engine's options and where it serves."""

    model: Path
    """Hugging Face model directory (config.json + safetensors)."""
    host: str = "127.0.0.1"
    """Address to bind (loopback by default)."""
    port: int = Field(30000, ge=0, le=65535)
    """Port to listen on."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (``cuda:N``)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Weights' dtype: ``auto`` keeps the checkpoint's."""
    weight_version: str = LAUNCH_WEIGHT_VERSION
    """Initial weight version reported by ``/model_info``."""
    api_key: str | None = Field(None, repr=False)
    """Require ``Authorization: Bearer <key>`` on every route but ``/health`` (default: the environment variable
    ``MILES_API_KEY``, which keeps the key off the command line). Needed to listen beyond loopback."""
    admin_api_key: str | None = Field(None, repr=False)
    """With it, the control routes (weights, pause, memory, flush, abort, LoRA, debug) need this key instead
    of the API key, as SGLang's ``--admin-api-key`` (default: the environment variable ``MILES_ADMIN_API_KEY``)."""

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value not in ("cpu", "cuda") and not value.startswith("cuda:"):
            raise ValueError(f"expected cpu or cuda, got {value!r}")
        return value

    @field_validator("model")
    @classmethod
    def _model_dir(cls, value: Path) -> Path:
        if not (value / "config.json").exists():
            raise ValueError(f"{value} is not a Hugging Face model directory (no config.json)")
        return value

    def server_info(self) -> dict[str, Any]:
        """What ``/server_info`` reports about the options (never the API key)."""
        info = self.model_dump(mode="json", exclude={*SECRET_FIELDS, "model"})
        info["model_path"] = str(self.model)
        return info


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def to_argv(options: EngineOptions) -> list[str]:
    """The command-line flags that reproduce ``options`` (fields left at ``None`` and switches at their default
    are omitted, a switch on by default is turned off by ``--no-<flag>``; keys never: they travel in the
    environment, :data:`SECRET_FIELDS`)."""
    argv: list[str] = []
    for name, info in type(options).model_fields.items():
        value = getattr(options, name)
        if value is None or name in SECRET_FIELDS:
            continue
        if isinstance(value, bool):
            if value != info.default:
                argv.append(_flag(name) if value else "--no-" + _flag(name)[2:])
            continue
        argv += [_flag(name), str(value)]
    return argv


def _scalar_type(annotation: Any) -> tuple[Any, list[str] | None]:
    """``(argparse type, choices)`` of a field annotation (``X | None`` is ``X``)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return str, [str(a) for a in args]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (inner,) = [a for a in args if a is not type(None)]
        return _scalar_type(inner)
    return (annotation if annotation in (int, float, str, Path) else str), None


def argument_parser(model: type[EngineOptions] = ServeOptions, *, prog: str = "miles serve") -> argparse.ArgumentParser:
    """An argument parser whose flags are ``model``'s fields (help from their docstrings)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Serve a model with the local engine (SGLang's HTTP protocol).", allow_abbrev=False
    )
    for name, info in model.model_fields.items():
        help_text = (info.description or "").replace("%", "%%").replace("``", "")
        if info.annotation is bool:  # on by default: --flag / --no-flag
            action = argparse.BooleanOptionalAction if info.default is True else "store_true"
            parser.add_argument(_flag(name), dest=name, action=action, default=None, help=help_text)
            continue
        kind, choices = _scalar_type(info.annotation)
        parser.add_argument(
            _flag(name),
            dest=name,
            type=kind,
            choices=choices,
            required=info.is_required(),
            default=None,
            help=help_text + ("" if info.is_required() else f" (default: {info.default})"),
        )
    return parser


def parse_serve_args(argv: Sequence[str]) -> ServeOptions:
    """``miles serve`` flags → :class:`ServeOptions`; a bad value raises :class:`SettingsError` naming the
    flag (usage errors exit 2 through argparse)."""
    parsed = vars(argument_parser().parse_args(list(argv)))
    env = ServiceKeys.from_env()
    parsed["api_key"] = parsed.get("api_key") or env.api_key
    parsed["admin_api_key"] = parsed.get("admin_api_key") or env.admin_api_key
    try:
        return ServeOptions.model_validate({k: v for k, v in parsed.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(f"{_flag(str(e['loc'][0]))}: {e['msg']}" for e in exc.errors())
        raise SettingsError(problems) from None
