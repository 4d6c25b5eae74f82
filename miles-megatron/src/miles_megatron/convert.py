"""``miles convert hf-to-megatron DIR OUT`` and ``miles convert megatron-to-hf CKPT OUT``.

``hf-to-megatron`` loads a HF safetensors directory into a Megatron ``GPTModel`` through mbridge (strict
key check first) and writes a model-only ``megatron.core.dist_checkpointing`` checkpoint, with the HF
config and tokenizer files in ``OUT/hf``. Distributed checkpoints reshard on load, so the trainer can
start from it at any tensor / pipeline layout (``train.model_path`` stays the HF directory for the config;
``--resume OUT`` or ``load_checkpoint(OUT)``). ``megatron-to-hf`` goes back: any checkpoint of this
package (converted or saved by the trainer) to a HF directory that ``transformers`` loads strictly.

The plugin's ``miles_register_commands`` hook adds both commands to the core's ``miles convert`` group
(:func:`register_commands`), beside ``miles convert gguf``; :data:`app` holds the same commands for
``python -m miles_megatron.convert``. Conversion runs in the calling process on one CPU rank (a gloo
world of 1, the CPU patches applied: a ``miles`` invocation is its own process). A bad input is a
:class:`~miles.errors.MilesError`: the message, no traceback, exit code 1.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from miles.errors import MilesError

__all__ = ["add_commands", "app", "convert_group", "hf_to_megatron", "megatron_to_hf", "register_commands"]

log = logging.getLogger(__name__)

HF_SUBDIR = "hf"
"""Where a converted checkpoint keeps the HF config and tokenizer files."""

GROUP = "convert"
"""The ``miles`` command group the conversion commands join (the core's, holding ``miles convert gguf``)."""


def _single_rank_world() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():  # a world of one: its store lives in this process, no port to take
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _build(hf_dir: str, weights: str | None) -> tuple[Any, Any]:
    import torch

    from miles_megatron.model import build_model, init_parallel, load_hf_config
    from miles_megatron.settings import MegatronSettings

    _single_rank_world()
    options = MegatronSettings()
    init_parallel(options, device="cpu", seed=0)
    config = load_hf_config(hf_dir)
    return build_model(config, options, device="cpu", dtype=torch.float32, weights=weights, trainable=False), config


def hf_to_megatron(src: str, out: str) -> Path:
    """Convert the HF directory ``src`` into a model-only Megatron distributed checkpoint at ``out``."""
    if not (Path(src) / "config.json").exists():
        raise FileNotFoundError(f"{src}: not a Hugging Face model directory (no config.json)")
    from megatron.core import dist_checkpointing

    from miles.training.hf_export import TOKENIZER_FILES
    from miles_megatron.checkpoint import STATE_FILE

    parts, config = _build(src, src)
    dst = Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / STATE_FILE).unlink(missing_ok=True)
    dist_checkpointing.save({"model": parts.module.sharded_state_dict()}, str(dst))
    hf = dst / HF_SUBDIR
    hf.mkdir(exist_ok=True)
    config.save_pretrained(hf)
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, hf / name)
    (dst / STATE_FILE).write_text(json.dumps({"step": 0, "model_only": True, "format": "megatron-dist-checkpointing"}))
    log.info("converted %s to a Megatron checkpoint at %s", src, dst)
    return dst


def _config_dir(ckpt: Path, hf_config_dir: str | None) -> str:
    if hf_config_dir is not None:
        return hf_config_dir
    if (ckpt / HF_SUBDIR / "config.json").exists():
        return str(ckpt / HF_SUBDIR)
    raise FileNotFoundError(
        f"{ckpt}: no {HF_SUBDIR}/config.json; pass --config DIR (the HF directory the model came from)"
    )


def megatron_to_hf(ckpt: str, out: str, *, hf_config_dir: str | None = None) -> Path:
    """Convert a Megatron checkpoint of this package (converted or trainer-saved, model part) to HF."""
    src = Path(ckpt)
    if not (src / "metadata.json").exists():
        raise FileNotFoundError(f"{ckpt}: not a Megatron distributed checkpoint (no metadata.json)")
    config_dir = _config_dir(src, hf_config_dir)
    from megatron.core import dist_checkpointing

    from miles_megatron.checkpoint import check_model_keys
    from miles_megatron.weights import export_hf_dir

    parts, config = _build(config_dir, None)
    model = parts.module
    check_model_keys(model, str(src))
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(src), strict="raise_all")
    model.load_state_dict(state["model"])
    export_hf_dir(parts.bridge, model, config, out, rank=0, bucket_bytes=1 << 30, source_dir=config_dir)
    return Path(out)


@contextlib.contextmanager
def _converting() -> Iterator[None]:
    """A bad input becomes a :class:`MilesError` (the message, no traceback); the one-rank world is torn
    down however the command ends."""
    try:
        yield
    except (FileNotFoundError, KeyError, ValueError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise MilesError(str(message)) from None
    finally:
        if "torch" in sys.modules:  # a bad path fails before torch is imported
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def hf_to_megatron_command(
    src: Annotated[Path, typer.Argument(help="Hugging Face safetensors directory.")],
    out: Annotated[Path, typer.Argument(help="Output directory (Megatron distributed checkpoint).")],
) -> None:
    """Convert a Hugging Face checkpoint to a Megatron distributed checkpoint (strict keys)."""
    with _converting():
        typer.echo(str(hf_to_megatron(str(src), str(out))))


def megatron_to_hf_command(
    ckpt: Annotated[Path, typer.Argument(help="Megatron checkpoint (converted, or saved by the trainer).")],
    out: Annotated[Path, typer.Argument(help="Output directory (HF safetensors, config, tokenizer).")],
    config: Annotated[
        Path | None, typer.Option("--config", help="HF directory with config.json (default: CKPT/hf).")
    ] = None,
) -> None:
    """Convert a Megatron checkpoint to a Hugging Face directory that transformers loads strictly."""
    with _converting():
        typer.echo(str(megatron_to_hf(str(ckpt), str(out), hf_config_dir=None if config is None else str(config))))


def add_commands(group: typer.Typer) -> None:
    """Add ``hf-to-megatron`` and ``megatron-to-hf`` to ``group``."""
    group.command("hf-to-megatron")(hf_to_megatron_command)
    group.command("megatron-to-hf")(megatron_to_hf_command)


def convert_group(root: typer.Typer) -> typer.Typer:
    """The ``convert`` group of the ``miles`` app (the core registers it); a new one when there is none."""
    for info in root.registered_groups:
        if info.name == GROUP and info.typer_instance is not None:
            return info.typer_instance
    group = typer.Typer(help="Convert checkpoints.", no_args_is_help=True)
    root.add_typer(group, name=GROUP)
    return group


def register_commands(root: typer.Typer) -> None:
    """``miles convert hf-to-megatron`` / ``megatron-to-hf`` (the plugin's ``miles_register_commands``)."""
    add_commands(convert_group(root))


app = typer.Typer(help="Convert between Hugging Face and Megatron checkpoints.", no_args_is_help=True)
"""The same commands for ``python -m miles_megatron.convert``."""
add_commands(app)


def main() -> None:
    """``python -m miles_megatron.convert``: a bad input prints its message (no traceback) and exits 1."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except MilesError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
