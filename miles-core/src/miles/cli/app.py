"""The typer application and the error boundary: a :class:`MilesError` prints its message, no traceback."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import sys
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from miles.errors import MilesError

if TYPE_CHECKING:
    from miles.plugins.manager import PluginManager

app = typer.Typer(
    name="miles",
    help="Miles: plugin-based RL post-training for language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)


def installed_packages() -> list[tuple[str, str]]:
    """(distribution, version) of every installed ``miles-*`` distribution."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.lower().replace("_", "-").startswith("miles-"):
            found[name] = dist.version
    return sorted(found.items())


def _version_callback(value: bool) -> None:
    if value:
        for name, version in installed_packages():
            typer.echo(f"{name} {version}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="List installed Miles packages."),
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)


@functools.cache
def plugin_manager() -> PluginManager:
    """The CLI process's plugin manager (loaded once; it also registered the plugins' commands)."""
    from miles.plugins.manager import PluginManager

    return PluginManager().load()


@functools.cache
def _register_commands() -> None:
    """The built-in commands, then every plugin's (``miles_register_commands``), once per process."""
    # imported here so that each command module can import `app` from this one
    from miles.cli import bench, convert, fleet, generate, plot, plugins, serve, sessions, train, view  # noqa: F401

    plugin_manager().register_commands(app)


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Usage errors are typer's (exit 2); a :class:`MilesError` prints its message,
    no traceback, and exits with its code."""
    _register_commands()
    try:
        app(args=argv)
    except MilesError as exc:
        # the message is text, not markup: "miles-sglang[sglang]" or "reward.functions[0]" print as written
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, markup=True, soft_wrap=True)
        sys.exit(exc.exit_code)
