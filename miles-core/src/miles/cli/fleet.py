"""``miles fleet add|remove|list RUN_DIR``: engines that join and leave a run while it goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from miles.cli.app import app
from miles.errors import LaunchError, SettingsError

fleet_app = typer.Typer(
    help="Add engines to a running run, or drain and remove them, while it goes on (see docs/how-to/ray.md).",
    no_args_is_help=True,
)
app.add_typer(fleet_app, name="fleet")

_RunDir = Annotated[Path, typer.Argument(help="The run's directory (log.run_dir), as the launching host sees it.")]
_Wait = Annotated[bool, typer.Option("--wait/--no-wait", help="Follow the request until it is done or failed.")]
_Timeout = Annotated[float, typer.Option(help="Seconds --wait follows the request.")]


def _follow(run_dir: Path, request: object, *, wait: bool, timeout: float) -> None:
    from miles.driver.fleet import FleetRequest, wait_for

    assert isinstance(request, FleetRequest)
    console = Console()
    if not wait:
        console.print(f"request {request.id} submitted; `miles fleet list {run_dir}` shows where it is")
        return
    result = wait_for(run_dir, request, timeout=timeout)
    if result.state == "done":
        console.print(f"[green]{result.action}[/]: {result.url} — {result.message}")
        return
    if result.state == "failed":
        raise LaunchError(f"fleet {result.action} {result.url or result.engine or ''} failed: {result.message}")
    raise LaunchError(
        f"fleet {result.action} {result.url or result.engine or ''} is still {result.state} after {timeout:g} s "
        f"(request {result.id}; `miles fleet list {run_dir}` follows it)"
    )


@fleet_app.command("add")
def add(
    run_dir: _RunDir,
    resources: Annotated[
        str | None,
        typer.Option(
            help="ray launcher: custom resources the new engine's node must offer, as JSON "
            "(e.g. '{\"late_node\": 1}'; default: cluster.launcher.engine_resources)."
        ),
    ] = None,
    wait: _Wait = True,
    timeout: _Timeout = 900.0,
) -> None:
    """Start one more engine; it serves once the next weight push (verified) has reached it."""
    from miles.driver.fleet import FleetRequest, submit

    wanted = None
    if resources is not None:
        try:
            wanted = {str(k): float(v) for k, v in json.loads(resources).items()}
        except (ValueError, AttributeError, TypeError) as exc:
            raise SettingsError(f"--resources: expected a JSON object of numbers, got {resources!r} ({exc})") from None
    _follow(run_dir, submit(run_dir, FleetRequest("add", resources=wanted)), wait=wait, timeout=timeout)


@fleet_app.command("remove")
def remove(
    run_dir: _RunDir,
    engine: Annotated[str, typer.Argument(help="The engine: its URL, or its name (engine-1, as in logs/).")],
    wait: _Wait = True,
    timeout: _Timeout = 900.0,
) -> None:
    """Drain an engine (no new requests; those in flight finish), then stop it."""
    from miles.driver.fleet import FleetRequest, submit

    _follow(run_dir, submit(run_dir, FleetRequest("remove", engine=engine)), wait=wait, timeout=timeout)


@fleet_app.command("list")
def show(run_dir: _RunDir) -> None:
    """The run's engines as trainer rank 0 sees them, and the requests not done yet."""
    from miles.driver.fleet import FINAL, read_members, read_status, requests_dir
    from miles.rollout.router import FLEET_FILE

    path = run_dir / FLEET_FILE
    if not path.exists():
        raise SettingsError(f"RUN_DIR: the run in {run_dir} has no engines running (no {FLEET_FILE})")
    fleet = json.loads(path.read_text())
    members = read_members(run_dir)
    table = Table("engine", "state")
    for url in [*fleet.get("engine_urls", []), *fleet.get("joining", [])]:
        table.add_row(url, members.get(url, "draining" if url in fleet.get("draining", []) else "starting"))
    console = Console()
    console.print(table)
    if fleet.get("router_url"):
        console.print(f"router: {fleet['router_url']}")
    for request_path in sorted(requests_dir(run_dir).glob("*.status.json")):
        status = read_status(run_dir, request_path.name.removesuffix(".status.json"))
        if status is not None and status.state not in FINAL:
            console.print(
                f"{status.id}: {status.action} {status.url or status.engine or ''} {status.state} {status.message}"
            )
