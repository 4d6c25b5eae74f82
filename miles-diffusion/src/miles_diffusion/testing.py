"""Helpers for tests, the example and the benchmark: the image engine as a child process."""

from __future__ import annotations

from pathlib import Path

from miles.testing.engine import EngineProcess

__all__ = ["ImageEngineProcess"]


class ImageEngineProcess(EngineProcess):
    """``python -m miles_diffusion.engine`` in a subprocess on 127.0.0.1, owned (and reaped) by this object.

    :param extra_args: more engine flags, e.g. ``["--num-steps", "6"]``.
    """

    module = "miles_diffusion.engine"

    def __init__(
        self,
        model_path: str | Path,
        *,
        extra_args: list[str] | None = None,
        threads: int = 1,
        log_path: str | Path | None = None,
        startup_timeout: float = 300.0,
    ) -> None:
        super().__init__(
            model_path, extra_args=extra_args, threads=threads, log_path=log_path, startup_timeout=startup_timeout
        )
