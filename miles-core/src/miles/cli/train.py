"""``miles train``: resolve settings, check every component, launch and supervise the run."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from miles.cli.app import app, plugin_manager
from miles.cli.render import render_choices, render_resolved
from miles.compose import Run, build_run
from miles.errors import SettingsError
from miles.settings.loader import load_settings

if TYPE_CHECKING:
    from miles.components import ComponentKind
    from miles.settings.model import MilesSettings


def resolve_run(
    config: Path | None,
    overrides: list[str],
    *,
    to_stderr: bool = False,
    kinds: Iterable[ComponentKind] | None = None,
    full: bool = False,
    check: Callable[[MilesSettings], object] | None = None,
    threads: bool = False,
) -> Run:
    """Load settings, resolve every component they select (or those of ``kinds``; errors name field and
    source), print a summary (``full``: every resolved setting) and the precision and transport with why they
    were chosen (``threads``: also the torch threads of trainer ranks and engines). ``check`` sees the loaded
    settings before any plugin is resolved."""
    if config is None and not overrides:
        raise SettingsError(
            "no config given: miles train CONFIG (a .toml or .yaml settings file, e.g. "
            "examples/quickstart/grpo_smollm2.toml), or settings with --set KEY=VALUE"
        )
    settings = load_settings(config, overrides=overrides)
    if check is not None:
        check(settings)
    run = build_run(settings, plugin_manager(), kinds=kinds)
    options = {field: resolved.options for field, resolved in run.resolved.items()}
    console = Console(stderr=to_stderr)
    render_resolved(console, settings, run.registrations(), full=full, options=options)
    render_choices(console, run.choices.values(), run.thread_split if threads else None)
    return run


@app.command()
def train(
    config: Annotated[Path | None, typer.Argument(help="Settings file (.toml / .yaml).")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a setting: --set train.lr=1e-5 (repeatable).")
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the resolved settings, the plugin serving each component, and the precision, transport and thread split with why they were chosen, then exit.",
        ),
    ] = False,
    resume: Annotated[
        str | None, typer.Option("--resume", help="Continue from a checkpoint, a checkpoint folder or a run directory.")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace what an earlier run left in log.run_dir (refused otherwise).")
    ] = False,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            help="Run the engine, the driver and the trainer in this one process (one rank), so breakpoint() "
            "and a debugger work anywhere.",
        ),
    ] = False,
) -> None:
    """Train a policy with RL (or SFT) as the settings describe."""
    from miles.host.rundir import check_run_dir

    run = resolve_run(
        config,
        set_ or [],
        full=dry_run,
        threads=True,
        check=None if dry_run else (lambda s: check_run_dir(s, resume=resume, overwrite=overwrite)),
    )
    if dry_run:
        try:  # what the real command would refuse, as a warning
            check_run_dir(run.settings, resume=resume, overwrite=overwrite)
        except SettingsError as exc:
            Console(stderr=True).print(f"[yellow]warning:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return
    if debug:
        from miles.host.debug import run_debug

        code = run_debug(run, resume=resume, overwrite=overwrite)
    else:
        from miles.host.train import run_training

        code = run_training(run, resume=resume, overwrite=overwrite, console=Console())
    if code:
        raise typer.Exit(code)
    Console().print(f"[green]done[/]: {run.settings.log.run_dir}")
