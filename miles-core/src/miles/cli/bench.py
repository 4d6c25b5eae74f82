"""``miles bench NAME [ARGS...]``: run ``benchmarks/NAME.py`` of a Miles checkout, forwarding ARGS.

The benchmarks are scripts of the repository (they compare Miles with its peers and need those peers
installed), not part of the installed package: the command finds the ``benchmarks/`` folder from the
current directory upwards, or takes ``--benchmarks-dir``. ``miles bench`` without a name lists them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from miles.cli.app import app
from miles.errors import MilesError

__all__ = ["find_benchmarks_dir", "list_benchmarks"]

_MARKER = "run_all.py"
"""A ``benchmarks/`` folder holding this file is a Miles benchmark suite."""


def find_benchmarks_dir(start: Path, explicit: Path | None = None) -> Path:
    """``explicit`` if given, else the first ``benchmarks/`` (holding ``run_all.py``) in ``start`` or a
    parent. Raises :class:`MilesError` naming the folder(s) looked at."""
    if explicit is not None:
        if not explicit.is_dir():
            raise MilesError(f"--benchmarks-dir {explicit}: no such folder")
        return explicit
    tried = []
    for folder in (start.resolve(), *start.resolve().parents):
        candidate = folder / "benchmarks"
        tried.append(candidate)
        if (candidate / _MARKER).is_file():
            return candidate
    raise MilesError(
        f"no benchmarks/ folder (with {_MARKER}) in {tried[0]} or any parent folder: run this from a Miles "
        "repository checkout, or pass --benchmarks-dir PATH"
    )


def list_benchmarks(folder: Path) -> dict[str, str]:
    """Benchmark name -> first line of its module docstring, for every ``*.py`` script of ``folder``
    (helper modules without a ``__main__`` guard are left out)."""
    found: dict[str, str] = {}
    for path in sorted(folder.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        if "__main__" not in source:
            continue
        try:
            doc = ast.get_docstring(ast.parse(source)) or ""
        except SyntaxError:
            doc = "(does not parse)"
        found[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog="Arguments after NAME go to the script: miles bench scaling --quick; miles bench run_all -- --help.",
)
def bench(
    ctx: typer.Context,
    name: Annotated[
        str | None, typer.Argument(help="Benchmark to run: benchmarks/NAME.py (omit to list them).")
    ] = None,
    benchmarks_dir: Annotated[
        Path | None,
        typer.Option(
            "--benchmarks-dir",
            help="The repository's benchmarks/ folder (default: found from the current directory upwards).",
        ),
    ] = None,
) -> None:
    """Run a benchmark script of the repository (GRPO vs TRL, engine, weight sync, trainer scaling, run_all)."""
    folder = find_benchmarks_dir(Path.cwd(), benchmarks_dir)
    available = list_benchmarks(folder)
    if name is None:
        width = max((len(n) for n in available), default=0)
        typer.echo(f"benchmarks in {folder}:")
        for bench_name, summary in available.items():
            typer.echo(f"  {bench_name.ljust(width)}  {summary}")
        return
    script = folder / f"{name.removesuffix('.py')}.py"
    if not script.is_file():
        raise MilesError(
            f"no benchmark {name!r}: {script} does not exist (available: {', '.join(available) or 'none'})"
        )
    # a module of the benchmarks package (its scripts import benchmarks.common), from the folder above it
    code = subprocess.call([sys.executable, "-m", f"{folder.name}.{script.stem}", *ctx.args], cwd=folder.parent)
    if code:
        # SystemExit, not typer.Exit: with standalone_mode=False click returns an Exit's code instead of exiting
        raise SystemExit(code)
