"""Start a local engine as a child process and wait until it answers (tests, benchmarks, scripts).

(It was ``miles.engine.process``, which re-exports it for one release.)

The process is owned by the :class:`EngineProcess` object: it is terminated (then killed) by
:meth:`EngineProcess.stop` or on leaving the ``with`` block, never looked up by name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, TypeVar

import httpx

from miles.net import ADDRESS_IN_USE_EXIT, free_port

__all__ = ["EngineProcess"]

E = TypeVar("E", bound="EngineProcess")


class EngineProcess:
    """``miles serve`` in a subprocess on 127.0.0.1.

    :param extra_args: more ``miles serve`` flags, e.g. ``["--max-cache-tokens", "64"]``.
    :param threads: torch threads of the engine (and ``OMP_NUM_THREADS``).
    """

    module = "miles.engine"
    """The engine's module, run as ``python -m module --model ... --port ... --threads ...`` (another engine that
    takes those flags, e.g. miles-diffusion's image engine, subclasses with its own)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        port: int | None = None,
        extra_args: list[str] | None = None,
        threads: int = 1,
        log_path: str | Path | None = None,
        startup_timeout: float = 180.0,
    ) -> None:
        self.model_path = str(model_path)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_args = list(extra_args or [])
        self.threads = threads
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None
        self.rebinds = 0
        """Starts on another port because the chosen one was taken before the engine bound it."""

    def start(self: E, wait: bool = True) -> E:
        argv = [
            sys.executable, "-m", self.module, "--model", self.model_path, "--port", str(self.port),
            "--threads", str(self.threads), *self.extra_args,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), TOKENIZERS_PARALLELISM="false")
        self._log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Poll ``/health`` until it answers 200; raise if the process exits or the timeout passes. An engine
        whose port was taken before it bound (its exit code says so) starts again on another port."""
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        headers = {}
        if "--api-key" in self.extra_args:
            headers["Authorization"] = "Bearer " + self.extra_args[self.extra_args.index("--api-key") + 1]
        while time.monotonic() < deadline:
            if self.proc.poll() == ADDRESS_IN_USE_EXIT and self.rebinds < 3:
                self.rebinds += 1
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
                self.stop()
                self.start(wait=False)
                continue
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine for {self.model_path} exited with code {self.proc.returncode} (log: {self.log_path})"
                )
            try:
                if httpx.get(self.url + "/health", headers=headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"engine for {self.model_path} did not answer /health within {self.startup_timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self: E) -> E:
        if self.proc is None:
            try:
                self.start()
            except BaseException:  # a process that never became ready is not left running
                self.stop()
                raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
