"""Start the image engine: load the pipeline, start the scheduler's worker, serve HTTP until signalled."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_diffusion.engine.options import ImageServeOptions
    from miles_diffusion.engine.scheduler import ImageScheduler

__all__ = ["build_engine", "main", "serve"]

log = logging.getLogger(__name__)


def build_engine(opts: ImageServeOptions) -> ImageScheduler:
    """Load the policy and start its scheduler (a worker thread)."""
    from miles_diffusion.engine.scheduler import ImageScheduler
    from miles_diffusion.policy import load_pipeline

    pipe = load_pipeline(opts.model, device=opts.device, dtype=opts.dtype)
    pipe.transformer.requires_grad_(False)
    scheduler = ImageScheduler(pipe, opts)
    scheduler.start()
    return scheduler


def create_engine_app(opts: ImageServeOptions) -> tuple[Any, ImageScheduler]:
    """The FastAPI app and its running scheduler (the caller stops the scheduler)."""
    from miles.auth import ServiceKeys, install_auth
    from miles_diffusion.engine.server import create_app

    scheduler = build_engine(opts)
    app = create_app(
        scheduler, model_path=str(opts.model), tokenizer=scheduler.pipe.tokenizer, server_args=opts.server_info()
    )
    install_auth(app, ServiceKeys(opts.api_key, opts.admin_api_key))  # the local engine's two levels
    return app, scheduler


def serve(opts: ImageServeOptions) -> None:
    """Serve until SIGINT / SIGTERM (uvicorn handles them), then stop the worker. A server that cannot
    bind exits with an error."""
    import torch
    import uvicorn

    from miles.auth import ServiceKeys, check_bind
    from miles.errors import SettingsError
    from miles.net import bind_or_exit

    try:
        check_bind(opts.host, ServiceKeys(opts.api_key), service="the image engine", setting="--api-key")
    except SettingsError as exc:
        log.error("%s", exc)
        raise SystemExit(exc.exit_code) from None
    sock = bind_or_exit(opts.host, opts.port, "miles image engine")  # a taken port fails before the model loads
    if opts.threads:
        torch.set_num_threads(opts.threads)
    app, scheduler = create_engine_app(opts)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=opts.host, port=opts.port, log_level="warning", access_log=False, timeout_graceful_shutdown=10
        )
    )
    log.info("serving %s on http://%s:%d", opts.model, opts.host, opts.port)
    try:
        server.run(sockets=[sock])
    finally:
        scheduler.stop()
    if not server.started:
        raise SystemExit(f"miles image engine: could not serve on http://{opts.host}:{opts.port} (see the error above)")


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and serve; a bad flag exits 2 naming it."""
    from miles.errors import MilesError
    from miles_diffusion.engine.options import parse_serve_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        opts = parse_serve_args(sys.argv[1:] if argv is None else argv)
    except MilesError as exc:
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(exc.exit_code)
    serve(opts)
