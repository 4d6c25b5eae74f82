"""``miles view RUN_DIR``: the trajectory viewer, a local page over a run directory (loopback by default)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from miles.cli.app import app
from miles.errors import MilesError

log = logging.getLogger(__name__)


@app.command()
def view(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (log.run_dir of a run, finished or not).")],
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: any free one; the URL is printed).")] = 8765,
) -> None:
    """Browse a run's samples token by token (rewards, train-vs-rollout logprob differences, masked
    tokens, multi-turn episodes) and its metric curves."""
    import uvicorn

    from miles.viewer.app import create_app
    from miles.viewer.data import RunData

    try:
        data = RunData(run_dir)
    except FileNotFoundError as exc:
        raise MilesError(str(exc)) from None
    from miles.net import bind_socket

    try:
        sock = bind_socket(host, port)  # port 0: the OS picks one as it binds
    except OSError as exc:
        raise MilesError(f"--port: cannot bind {host}:{port}: {exc.strerror or exc}") from None
    typer.echo(f"miles view: http://{host}:{sock.getsockname()[1]}/ ({run_dir}; Ctrl-C to stop)")
    server = uvicorn.Server(uvicorn.Config(create_app(data), log_level="warning", access_log=False))
    server.run(sockets=[sock])
