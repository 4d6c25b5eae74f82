"""``miles plot RUN_DIR``: PNG curves of reward, KL, train/rollout mismatch and step time."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from miles.cli.app import app
from miles.errors import MilesError


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (holds metrics.jsonl).")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="PNG to write (default RUN_DIR/curves.png).")] = None,
) -> None:
    """Plot a run's metrics."""
    from miles.metrics.plot import plot_run

    try:
        path = plot_run(run_dir, out)
    except (FileNotFoundError, ValueError) as exc:
        raise MilesError(str(exc)) from None
    typer.echo(str(path))
