"""``miles train``: resolve settings, check every component, and run (``--dry-run`` stops after printing)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from miles.cli.app import app
from miles.plugins.manager import PluginManager
from miles.settings.loader import load_settings


def resolve_run(config: Path | None, overrides: list[str]) -> tuple[object, dict[str, object]]:
    settings = load_settings(config, overrides=overrides)
    chosen = PluginManager().validate_settings(settings)
    return settings, chosen


@app.command()
def train(
    config: Annotated[Path | None, typer.Argument(help="Settings file (.toml / .yaml).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a setting: --set train.lr=1e-5 (repeatable).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved settings and the plugin serving each component, then exit.")] = False,
) -> None:
    """Train a policy with RL (or SFT) as the settings describe."""
    from miles.settings.render import render_resolved

    settings, chosen = resolve_run(config, set_ or [])
    console = Console()
    render_resolved(console, settings, chosen)  # type: ignore[arg-type]
    if dry_run:
        return
    from miles.errors import MilesError

    raise MilesError("the training driver is not part of this release yet; use --dry-run to check a configuration")
