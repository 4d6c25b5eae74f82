"""The image engine's options: the run's ``[rollout.engine]`` table (``name = "diffusion"``), the flags of
``python -m miles_diffusion.engine`` and what ``/server_info`` reports — one model, as the local engine's.

Flags are the field names with dashes (``--num-steps``); booleans are switches; a window is two numbers.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from miles.auth import SECRET_FIELDS, ServiceKeys
from miles.components import ComponentSettings
from miles.errors import SettingsError

__all__ = ["ImageEngineOptions", "ImageServeOptions", "parse_serve_args", "to_argv"]


class ImageEngineOptions(ComponentSettings):
    """Settings of the image engine (``rollout.engine = {name = "diffusion", ...}``): how it samples."""

    num_steps: int = Field(10, ge=1)
    """Denoising steps of the schedule (Flow-GRPO trains with 10)."""
    height: int | None = Field(None, ge=8)
    """Image height in pixels (default: the pipeline's default sample size)."""
    width: int | None = Field(None, ge=8)
    """Image width in pixels (default: the pipeline's default sample size)."""
    guidance_scale: float = Field(1.0, ge=0.0)
    """Classifier-free guidance; above 1 each step also runs the empty prompt (SD3's recipes use 4.5)."""
    noise_level: float = Field(0.7, gt=0.0)
    """Flow-GRPO's ``eta``: the SDE's noise scale ``eta * sqrt(s / (1 - s))``."""
    sde_window: tuple[int, int] | None = None
    """Steps ``[start, end)`` sampled with the SDE (and trained on); the others are ODE steps. ``None``: all."""
    max_sequence_length: int = Field(256, ge=1)
    """Prompt tokens of the T5 part of the prompt embedding (SD3's ``max_sequence_length``)."""
    max_batch_size: int = Field(8, ge=1)
    """Images denoised together at most (one batch through the transformer)."""
    enable_deterministic_inference: bool = False
    """Every image is denoised on its own, so it depends on its prompt, seed and weights only, never on
    which requests share its batch — a run and its resume reproduce the engine's images and log-probs bit
    for bit. Slower: no batching."""
    threads: int | None = Field(None, ge=1)
    """torch intra-op threads of the engine process (default: torch's choice)."""
    enable_debug_endpoints: bool = False
    """Serve ``/debug/randomize_weights`` (for ``transport.randomize_engines_first``)."""

    @model_validator(mode="after")
    def _window(self) -> ImageEngineOptions:
        if self.sde_window is not None:
            start, end = self.sde_window
            if not 0 <= start < end <= self.num_steps:
                raise ValueError(f"sde_window: [{start}, {end}) must lie within the {self.num_steps} steps")
        return self


class ImageServeOptions(ImageEngineOptions):
    """Everything one engine process needs: the options and where it serves."""

    model: Path
    """A diffusers pipeline directory (``model_index.json``)."""
    host: str = "127.0.0.1"
    """Address to bind (loopback by default)."""
    port: int = Field(30000, ge=0, le=65535)
    """Port to listen on."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (``cuda:N``)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the transformer's weights (latents and the SDE stay float32)."""
    weight_version: str = "0"
    """Initial weight version reported by ``/model_info``."""
    api_key: str | None = Field(None, repr=False)
    """Require ``Authorization: Bearer <key>`` on every route but ``/health`` (default: the environment variable
    ``MILES_API_KEY``). Needed to listen beyond loopback (:mod:`miles.auth`)."""
    admin_api_key: str | None = Field(None, repr=False)
    """With it, the control routes need this key instead (default: ``MILES_ADMIN_API_KEY``)."""

    def server_info(self) -> dict[str, Any]:
        """What ``/server_info`` reports (JSON values; never a key)."""
        return self.model_dump(mode="json", exclude=set(SECRET_FIELDS))


def to_argv(options: ImageServeOptions) -> list[str]:
    """The flags that reproduce ``options`` (defaults left out)."""
    argv: list[str] = []
    defaults = {name: field.default for name, field in ImageServeOptions.model_fields.items()}
    for name, value in options.model_dump().items():
        if (name != "model" and value == defaults.get(name)) or name in SECRET_FIELDS:  # keys: in the environment
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag)
        elif isinstance(value, (tuple, list)):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def parse_serve_args(argv: Sequence[str]) -> ImageServeOptions:
    """Parse flags into options; a bad value raises :class:`SettingsError` naming the flag."""
    parser = argparse.ArgumentParser(prog="python -m miles_diffusion.engine", description="the Miles image engine")
    for name, field in ImageServeOptions.model_fields.items():
        flag = "--" + name.replace("_", "-")
        annotation = str(field.annotation)
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action="store_true", help=field.description)
        elif "tuple" in annotation:
            parser.add_argument(flag, dest=name, nargs=2, type=int, help=field.description)
        else:
            parser.add_argument(flag, dest=name, required=name == "model", help=field.description)
    args = {k: v for k, v in vars(parser.parse_args(list(argv))).items() if v is not None and v is not False}
    env = ServiceKeys.from_env()
    for name, value in (("api_key", env.api_key), ("admin_api_key", env.admin_api_key)):
        if value and name not in args:
            args[name] = value
    try:
        return ImageServeOptions(**args)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "--" + "-".join(str(p) for p in first["loc"][:1]).replace("_", "-")
        raise SettingsError(f"{where}: {first['msg']}") from None
