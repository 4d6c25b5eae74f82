"""``miles train``: resolve settings, check every component, launch and supervise the run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from miles.cli.app import app
from miles.plugins.manager import PluginManager
from miles.settings.loader import load_settings
from miles.settings.model import MilesSettings
from miles.settings.render import render_resolved


def resolve_run(config: Path | None, overrides: list[str], *, to_stderr: bool = False) -> MilesSettings:
    """Load settings, check every component they select (errors name field and source), print them."""
    settings = load_settings(config, overrides=overrides)
    chosen = PluginManager().validate_settings(settings)
    render_resolved(Console(stderr=to_stderr), settings, chosen)
    return settings


@app.command()
def train(
    config: Annotated[Path | None, typer.Argument(help="Settings file (.toml / .yaml).")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a setting: --set train.lr=1e-5 (repeatable).")
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print the resolved settings and the plugin serving each component, then exit."),
    ] = False,
    resume: Annotated[
        str | None, typer.Option("--resume", help="Continue from a checkpoint, a checkpoint folder or a run directory.")
    ] = None,
) -> None:
    """Train a policy with RL (or SFT) as the settings describe."""
    settings = resolve_run(config, set_ or [])
    if dry_run:
        return
    from miles.driver.launch import run_training

    code = run_training(settings, resume=resume, console=Console())
    if code:
        raise typer.Exit(code)
    Console().print(f"[green]done[/]: {settings.log.run_dir}")
