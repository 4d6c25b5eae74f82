"""Build and run a local engine: load the model and tokenizer, start the scheduler, serve HTTP."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

__all__ = ["build_engine", "serve"]

log = logging.getLogger(__name__)


def _eos_ids(model_path: Path, config: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    candidates: list[Any] = [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    try:
        from transformers import GenerationConfig

        candidates.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:
        pass
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def build_engine(
    model_path: str | Path,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    max_cache_tokens: int = 1 << 16,
    max_kv_tokens: int | None = None,
    max_running_requests: int = 64,
    context_length: int | None = None,
    weight_version: str = "0",
    api_key: str | None = None,
    return_raw_logprob: bool = False,
    enable_deterministic_inference: bool = False,
    attention_backend: str = "auto",
    server_args: dict[str, Any] | None = None,
    start: bool = True,
) -> Any:
    """Load everything and (``start``) start the scheduler on a background thread; returns the
    :class:`EngineState`. ``start=False``: the caller runs the loop (``Scheduler.run_forever``)."""
    from transformers import AutoTokenizer

    from miles.engine.model_runner import ModelRunner
    from miles.engine.scheduler import Scheduler, SchedulerConfig
    from miles.engine.server import EngineState

    path = Path(model_path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json)")
    runner = ModelRunner(path, device=device, dtype=dtype, attention_backend=attention_backend)
    tokenizer = AutoTokenizer.from_pretrained(path)

    def text_of(ids: list[int], skip_special: bool) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=skip_special))

    scheduler = Scheduler(
        runner,
        _eos_ids(path, runner.config, tokenizer),
        SchedulerConfig(
            max_running_requests=max_running_requests,
            max_cache_tokens=max_cache_tokens,
            max_kv_tokens=max_kv_tokens,
            context_length=context_length,
            weight_version=weight_version,
            deterministic=enable_deterministic_inference,
        ),
        text_of,
    )
    if start:
        scheduler.start()
    return EngineState(
        scheduler=scheduler,
        tokenizer=tokenizer,
        model_path=str(path),
        api_key=api_key,
        server_args=dict(server_args or {}),
        return_raw_logprob=return_raw_logprob,
    )


def serve(
    model_path: str | Path, *, host: str = "127.0.0.1", port: int = 30000, threads: int | None = None, **kwargs: Any
) -> None:
    """Serve ``model_path`` until interrupted or terminated (what ``miles serve`` runs).

    The scheduler runs on the main thread (see :meth:`Scheduler.run_forever`), HTTP on a second one;
    SIGINT / SIGTERM stop both. A server that cannot bind exits with an error.
    """
    import signal
    import threading

    import torch
    import uvicorn

    from miles.engine.server import create_app

    if threads:
        torch.set_num_threads(threads)
    debug = bool(kwargs.pop("enable_debug_endpoints", False))
    args = {
        "model_path": str(model_path),
        "host": host,
        "port": port,
        **{k: v for k, v in kwargs.items() if k != "api_key"},
    }
    args["enable_debug_endpoints"] = debug
    state = build_engine(model_path, server_args=args, start=False, **kwargs)
    scheduler = state.scheduler
    config = uvicorn.Config(
        create_app(state), host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=10
    )
    server = uvicorn.Server(config)

    def http() -> None:
        try:
            server.run()
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
    log.info("serving %s on http://%s:%d", model_path, host, port)
    try:
        scheduler.run_forever()
    finally:
        server.should_exit = True
        thread.join(timeout=15)
    if not server.started and not signalled:
        raise SystemExit(f"miles serve: could not serve on http://{host}:{port} (see the error above)")
