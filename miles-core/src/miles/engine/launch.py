"""Build and run a local engine: load the model and tokenizer, start the scheduler, serve HTTP.

``freeze_startup_objects`` moved to :mod:`miles.startup`; the name stays importable from here for one release.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.startup import freeze_startup_objects

if TYPE_CHECKING:
    from miles.engine.options import ServeOptions

__all__ = ["InProcessEngine", "build_engine", "main", "serve", "start_engine"]

log = logging.getLogger(__name__)


def build_engine(model_path: str | Path, *, start: bool = True, **options: Any) -> Any:
    """Load everything and (``start``) start the scheduler on a background thread; returns the
    :class:`EngineState`. ``options`` are :class:`~miles.engine.options.ServeOptions` fields.
    ``start=False``: the caller runs the loop (``Scheduler.run_forever``)."""
    from miles.engine.options import ServeOptions

    try:
        opts = ServeOptions(model=Path(model_path), **options)
    except ValueError as exc:
        if not (Path(model_path) / "config.json").exists():
            raise FileNotFoundError(f"{model_path}: not a Hugging Face model directory (no config.json)") from None
        raise exc
    return start_engine(opts, start=start)


def start_engine(opts: ServeOptions, *, start: bool = True) -> Any:
    """:func:`build_engine` for validated options."""
    from transformers import AutoTokenizer

    from miles.engine.model_runner import ModelRunner
    from miles.engine.scheduler import Scheduler, SchedulerConfig
    from miles.engine.state import EngineState
    from miles.engine.weight_paths import WeightDirs, parse_weight_dirs
    from miles.models import eos_token_ids

    path = opts.model
    runner = ModelRunner(
        path,
        device=opts.device,
        dtype=opts.dtype,
        attention_backend=opts.attention_backend,
        quantization=opts.quantization,
        invariant=opts.enable_deterministic_inference,
        huge_pages=opts.huge_pages,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    images = None
    if runner.is_vision:
        from miles.data.vision import load_image_processor
        from miles.engine.multimodal import ImageParser

        images = ImageParser(runner.model, load_image_processor(path))

    def text_of(ids: list[int], skip_special: bool) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=skip_special))

    scheduler = Scheduler(
        runner,
        eos_token_ids(path, config=runner.config, tokenizer=tokenizer),
        SchedulerConfig(
            max_running_requests=opts.max_running_requests,
            max_cache_tokens=opts.max_cache_tokens,
            max_kv_tokens=opts.max_kv_tokens,
            context_length=opts.context_length,
            weight_version=opts.weight_version,
            deterministic=opts.enable_deterministic_inference,
        ),
        text_of,
    )
    if start:
        scheduler.start()
    return EngineState(
        scheduler=scheduler,
        tokenizer=tokenizer,
        model_path=str(path),
        api_key=opts.api_key,
        admin_api_key=opts.admin_api_key,
        server_args=opts.server_info(),
        return_original_logprob=opts.return_original_logprob,
        images=images,
        weight_dirs=WeightDirs(
            [
                path,
                *parse_weight_dirs(opts.allowed_weight_dirs),
                *parse_weight_dirs(os.environ.get("MILES_ALLOWED_WEIGHT_DIRS")),
            ]
        ),
    )


def refuse_open_bind(opts: ServeOptions, service: str) -> None:
    """Exit (code 2, one line naming ``--api-key``) rather than serve beyond loopback without a key."""
    from miles.auth import ServiceKeys, check_bind
    from miles.errors import SettingsError

    try:
        check_bind(opts.host, ServiceKeys(opts.api_key, opts.admin_api_key), service=service, setting="--api-key")
    except SettingsError as exc:
        log.error("%s", exc)
        raise SystemExit(exc.exit_code) from None


def serve(opts: ServeOptions) -> None:
    """Serve until interrupted or terminated (what ``miles serve`` and ``python -m miles.engine`` run).

    The scheduler runs on the main thread (see :meth:`Scheduler.run_forever`), HTTP on a second one;
    SIGINT / SIGTERM stop both. A server that cannot bind exits with an error.
    """
    import signal
    import threading

    import torch
    import uvicorn

    from miles.engine.server import create_app
    from miles.net import bind_or_exit
    from miles.torch_threads import set_torch_threads, single_threaded_here

    host, port = opts.host, opts.port
    refuse_open_bind(opts, "miles serve")
    sock = bind_or_exit(host, port, "miles serve")  # before the model loads: a taken port fails in a second
    # the scheduler's count is set (and initialised) on this thread before the HTTP thread sets its own
    set_torch_threads(opts.threads or torch.get_num_threads())
    state = start_engine(opts, start=False)
    scheduler = state.scheduler
    freeze_startup_objects()
    config = uvicorn.Config(
        create_app(state), host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=10
    )
    server = uvicorn.Server(config)

    def http() -> None:
        # torch work on this thread (weight routes, checksums) runs single-threaded: a second OpenMP pool in
        # the process would slow every parallel region of the scheduler's (see miles.torch_threads)
        single_threaded_here()
        try:
            server.run(sockets=[sock])
        finally:
            scheduler.stop()  # the HTTP side ended (shutdown, or it could not bind): so does the engine

    signalled: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        log.info("received signal %d: shutting down", signum)
        signalled.append(signum)
        scheduler.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    thread = threading.Thread(target=http, name="miles-http", daemon=True)
    thread.start()
    log.info("serving %s on http://%s:%d", opts.model, host, port)  # bound above; listening once uvicorn starts
    try:
        scheduler.run_forever()
    finally:
        server.should_exit = True
        thread.join(timeout=15)
    if not server.started and not signalled:
        raise SystemExit(f"miles serve: could not serve on http://{host}:{port} (see the error above)")


class InProcessEngine:
    """A local engine inside this process (``miles train --debug``): the scheduler and HTTP on background
    threads, so a debugger stops anywhere in the process. Use as a context manager; the URL is ``url``."""

    def __init__(self, opts: ServeOptions) -> None:
        self.opts = opts
        """(``port`` 0: the OS picks one as the engine binds; :attr:`url` names it once entered)"""
        self.url = f"http://{opts.host}:{opts.port}"
        self._server: Any = None
        self._thread: Any = None
        self._state: Any = None

    def __enter__(self) -> InProcessEngine:
        import threading
        import time

        import uvicorn

        from miles.auth import ServiceKeys, check_bind
        from miles.engine.server import create_app
        from miles.net import bind_socket

        keys = ServiceKeys(self.opts.api_key, self.opts.admin_api_key)
        check_bind(self.opts.host, keys, service="the in-process engine", setting="MILES_API_KEY")
        sock = bind_socket(self.opts.host, self.opts.port)
        self.url = f"http://{self.opts.host}:{sock.getsockname()[1]}"
        self._state = start_engine(self.opts, start=True)
        config = uvicorn.Config(create_app(self._state), log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the process's handlers stay the driver's
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="miles-engine-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the in-process engine could not serve on {self.url}")
            time.sleep(0.05)
        log.info("in-process engine serving %s on %s", self.opts.model, self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=15)
        if self._state is not None:
            self._state.scheduler.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m miles.engine`` / ``miles serve``: parse the flags, serve. A bad flag exits 2 naming it."""
    import sys

    from miles.engine.options import parse_serve_args
    from miles.errors import MilesError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        opts = parse_serve_args(sys.argv[1:] if argv is None else argv)
    except MilesError as exc:
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(exc.exit_code)
    serve(opts)
