"""The typer application and the error boundary: a :class:`MilesError` prints its message, no traceback."""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
import re
import sys
from typing import TYPE_CHECKING, Annotated, Any

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


class _StderrNow(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record is logged: while a rich progress bar is shown (it
    redirects ``sys.stderr``), log lines print above the bar instead of into it."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


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
        handlers=[_StderrNow()],
    )
    if not verbose:
        for client in ("httpx", "httpx2"):  # openai 3 logs its requests through httpx2
            logging.getLogger(client).setLevel(logging.WARNING)


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


_ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|obj|exc):`~?(?:[\w.]+\.)?([\w]+)`")


def plain_help(text: str | None) -> str | None:
    """A docstring as terminal help: reST's ``code`` and :role:`~a.b.name` read as `code` and name."""
    if not text:
        return text
    return _ROLE.sub(r"\1", text).replace("``", "`")


def _plain_helps(typer_app: typer.Typer) -> None:
    """Every command's help (its docstring unless given) as :func:`plain_help`, in the groups too."""
    for command in typer_app.registered_commands:
        if command.callback is not None:
            command.help = plain_help(command.help or inspect.getdoc(command.callback))
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _plain_helps(group.typer_instance)


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Usage errors are typer's (exit 2); a :class:`MilesError` prints its message,
    no traceback, and exits with its code."""
    _register_commands()
    _plain_helps(app)
    try:
        app(args=argv)
    except MilesError as exc:
        # the message is text, not markup: "miles-sglang[sglang]" or "reward.functions[0]" print as written
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, markup=True, soft_wrap=True)
        sys.exit(exc.exit_code)
