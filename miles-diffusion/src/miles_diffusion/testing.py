"""Helpers for tests, the example and the benchmark: the image engine as a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from miles.testing.engine import EngineProcess

__all__ = ["ImageEngineProcess"]


class ImageEngineProcess(EngineProcess):
    """``python -m miles_diffusion.engine`` in a subprocess on 127.0.0.1, owned (and reaped) by this object.

    :param extra_args: more engine flags, e.g. ``["--num-steps", "6"]``.
    """

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

    def start(self, wait: bool = True) -> ImageEngineProcess:
        argv = [
            sys.executable, "-m", "miles_diffusion.engine", "--model", self.model_path, "--port", str(self.port),
            "--threads", str(self.threads), *self.extra_args,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), TOKENIZERS_PARALLELISM="false")
        self._log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self
