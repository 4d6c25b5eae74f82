"""``miles plugins list``: every plugin, what it registers, and whether it loaded."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from miles.cli.app import app, plugin_manager

plugins_app = typer.Typer(help="Inspect installed plugins.", no_args_is_help=True)
app.add_typer(plugins_app, name="plugins")

JSON_SCHEMA_VERSION = 1


@plugins_app.command("list")
def list_plugins(
    as_json: Annotated[
        bool, typer.Option("--json", help="Machine-readable output (schema in docs/reference/cli.md).")
    ] = False,
    hook: Annotated[
        str | None, typer.Option("--hook", help="Only plugins implementing this hook (e.g. miles_register_rewards).")
    ] = None,
    traceback: Annotated[bool, typer.Option("--traceback", help="Show the traceback of failed plugins.")] = False,
) -> None:
    """List built-in and installed plugins: name, distribution, version, registrations, status."""
    records = plugin_manager().records()
    if hook is not None:
        records = [r for r in records if hook in r.hooks]
    if as_json:
        typer.echo(
            json.dumps({"schema_version": JSON_SCHEMA_VERSION, "plugins": [r.to_json() for r in records]}, indent=2)
        )
        return
    table = Table(title="Miles plugins", show_lines=False)
    for column in ("plugin", "distribution", "version", "registers", "status"):
        table.add_column(column, overflow="fold")
    for r in records:
        registers = [f"{kind.replace('_', ' ')}: {name}" for kind, name in r.registers]
        registers += [f"command: miles {name}" for name in r.commands]
        if r.status == "ok":
            status = "[green]ok[/]"
        elif r.status == "blocked":
            status = f"[yellow]blocked[/]: {r.error}"
        else:
            status = f"[red]failed[/]: {r.error}"
        table.add_row(r.name, r.distribution, r.version, "\n".join(registers) or "-", status)
    console = Console(width=max(Console().width, 120))
    console.print(table)
    if traceback:
        for r in records:
            if r.traceback:
                console.rule(f"{r.name} ({r.distribution})")
                console.print(r.traceback, markup=False, highlight=False)
