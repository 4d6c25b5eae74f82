"""The ``local`` launcher: trainer ranks and engine servers as child processes of this host.

Every child runs in its own session (so a terminal's Ctrl-C reaches only the driver, which then stops
them in order), writes to ``<run_dir>/logs/<name>.log`` and is reaped by :meth:`LocalLauncher.shutdown`:
SIGTERM to each child's process group, a grace period, then SIGKILL. The same code serves GPUs:
``CUDA_VISIBLE_DEVICES`` comes with each :class:`EngineLaunch` / :class:`ProcessSpec` environment.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from pydantic import Field

from miles.components import ComponentSettings
from miles.errors import LaunchError
from miles.launch import cleanup
from miles.launch.base import Launcher, ProcessSpec
from miles.launch.process import LocalProcess, SupervisedProcess, describe_exit
from miles.launch.rendezvous import RendezvousStore
from miles.net import address_in_use
from miles.rollout.backend import EngineLaunch

if TYPE_CHECKING:
    import httpx

__all__ = ["LocalLauncher", "LocalLauncherSettings"]

log = logging.getLogger(__name__)


_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:.,]+\s+(?:rank\d+\s+)?[A-Z]+\s+[\w.]+:\s*")


def status_of(line: str, width: int = 160) -> str:
    """A child's log line as a status: without its time, level and logger, its head kept (``building the
    CPU kernels ...``), cut at ``width`` characters with ``...``."""
    text = _LOG_PREFIX.sub("", line.strip())
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


class LocalLauncherSettings(ComponentSettings):
    """Settings of the ``local`` launcher."""

    terminate_timeout: float = Field(10.0, gt=0)
    """Seconds children get between SIGTERM and SIGKILL at shutdown."""
    poll_interval: float = Field(0.2, gt=0)
    """Seconds between checks of the children and of engine health URLs."""
    progress_interval: float = Field(10.0, gt=0)
    """While engines start, say every this many seconds what each is doing (its latest log line)."""
    log_tail_lines: int = Field(40, ge=1)
    """Lines of a failed process's log quoted in its error."""
    failure_grace: float = Field(3.0, ge=0)
    """After a trainer rank fails, seconds to wait for another rank killed by a signal, which the run's
    error then names: a killed rank's peers fail at once in their collectives ("Connection closed by peer"),
    and their exit may be seen first (Ray reports a dead actor later than its peers' exits)."""
    die_with_parent: bool = True
    """Linux: children get SIGKILL from the kernel if this process dies without shutting them down
    (``kill -9``, a segfault). It is tied to the thread that starts them: start them from the main thread."""
    handle_signals: bool = True
    """Stop every child on SIGINT / SIGTERM / SIGHUP (installed from the main thread only)."""


class LocalLauncher(Launcher[LocalLauncherSettings]):
    """Runs trainer ranks and engine servers as processes on this host."""

    name = "local"

    def __init__(self, settings: LocalLauncherSettings | None = None, *, run_dir: str | None = None) -> None:
        settings = settings if settings is not None else LocalLauncherSettings()
        super().__init__(settings, run_dir=run_dir if run_dir is not None else tempfile.mkdtemp(prefix="miles-run-"))
        assert self.run_dir is not None
        self.log_dir = os.path.join(self.run_dir, "logs")
        """Where each child's ``<name>.log`` goes."""
        self.processes: list[SupervisedProcess] = []
        """Every process started, in order (reaped ones included)."""
        self.engines: list[SupervisedProcess] = []
        self._starting: list[tuple[SupervisedProcess, str]] = []
        """Engines started without waiting, with their health URLs (see :meth:`wait_engines`)."""
        self.trainers: list[SupervisedProcess] = []
        self.engine_urls: list[str] = []
        """The base URL of each engine of :attr:`engines` (final once it answers)."""
        self._launches: dict[str, EngineLaunch] = {}
        """Each engine's launch, by process name (an engine whose port was taken is launched again elsewhere)."""
        self._rendezvous: RendezvousStore | None = None
        self._closed = False
        self._stopping = False
        self._stopped = False

    # -- starting ----------------------------------------------------------------------------------
    def start_process(self, spec: ProcessSpec) -> SupervisedProcess:
        if self._closed:
            raise LaunchError(f"cannot start {spec.name!r}: the launcher was shut down")
        if any(p.name == spec.name and not p.reaped and p.exit_status() is None for p in self.processes):
            raise ValueError(f"a process named {spec.name!r} is already running")
        os.makedirs(self.log_dir, exist_ok=True)
        cleanup.track(self, handle_signals=self.settings.handle_signals)
        process = LocalProcess(spec, self.log_dir, die_with_parent=self.settings.die_with_parent)
        self.processes.append(process)
        return process

    def _start_member(self, spec: ProcessSpec, role: str, index: int) -> SupervisedProcess:
        """Start engine ``index`` or trainer rank ``index`` (``role``); here a child of this host."""
        return self.start_process(spec)

    def _start_engine(self, launch: EngineLaunch, index: int) -> SupervisedProcess:
        spec = ProcessSpec(name=f"engine-{index}", argv=list(launch.argv), env=dict(launch.env))
        process = self._start_member(spec, "engine", index)
        self._launches[spec.name] = launch
        return process

    def start_engines(self, launches: list[EngineLaunch], *, timeout: float, wait: bool = True) -> list[str]:
        started: list[SupervisedProcess] = []
        first = len(self.engines)
        try:
            for i, launch in enumerate(launches):
                started.append(self._start_engine(launch, first + i))
        except BaseException:
            self._stop(started)
            raise
        self.engines.extend(started)
        self.engine_urls.extend(launch.url for launch in launches)
        self._starting.extend(
            (p, launch.url.rstrip("/") + launch.health_path) for p, launch in zip(started, launches, strict=True)
        )
        if wait:
            self.wait_engines(timeout=timeout)
        return self.engine_urls[first:]

    def _rebind(self, process: SupervisedProcess) -> tuple[SupervisedProcess, str] | None:
        """Start an engine whose port was taken before it bound again on another address; ``None`` when its
        launch cannot move. Said once in the log, with both ports."""
        launch = self._launches[process.name]
        if launch.rebind is None:
            return None
        index = self.engines.index(process)
        process.reap()
        old = urlsplit(launch.url)
        host, port = self.engine_address(index, old.hostname or "127.0.0.1")
        moved = launch.rebind(host, port)
        log.warning(
            "%s: port %s was taken before the engine could bind it; starting it again on %s",
            process.name,
            old.port,
            moved.url,
        )
        again = self._start_engine(moved, index)
        self.engines[index] = again
        self.engine_urls[index] = moved.url
        return again, moved.url.rstrip("/") + moved.health_path

    def _probe(self, pending: dict[str, tuple[SupervisedProcess, str]], client: httpx.Client) -> None:
        """One look at each engine of ``pending`` (name -> process, health URL): those that answer leave it, one
        whose port was taken is started again elsewhere, one that exited raises."""
        import httpx

        for name, (process, url) in list(pending.items()):
            code = process.exit_status()
            if code is not None and address_in_use(code, process.log_tail(self.settings.log_tail_lines)):
                moved = self._rebind(process)
                if moved is not None:
                    pending[name] = moved
                    continue
            if code is not None:
                raise self._failure(process, f"{name} exited ({describe_exit(code)}) before answering {url}", code)
            try:
                if client.get(url).status_code == 200:
                    log.info("%s is up at %s (%.1f s)", name, url, time.monotonic() - process.started_at)
                    del pending[name]
            except httpx.TransportError:
                pass

    def wait_engines(self, *, timeout: float) -> list[str]:
        import httpx

        pending = {p.name: (p, url) for p, url in self._starting}
        if not pending:
            return list(self.engine_urls)
        try:
            deadline = time.monotonic() + timeout
            next_note = time.monotonic() + self.settings.progress_interval
            headers = self.keys.headers() if self.keys is not None else {}
            with httpx.Client(timeout=min(5.0, timeout), trust_env=False, headers=headers) as client:
                while pending:
                    self._probe(pending, client)
                    if pending and time.monotonic() >= deadline:
                        process, url = next(iter(pending.values()))
                        raise self._failure(
                            process, f"{process.name} did not answer {url} with 200 within {timeout:g} s", None
                        )
                    if pending:
                        next_note = self._note_progress(pending, next_note)
                        time.sleep(self.settings.poll_interval)
        except BaseException:
            self._stop([p for p, _ in self._starting] + [p for p, _ in pending.values()])
            raise
        finally:
            self._starting = []
        return list(self.engine_urls)

    def add_engine(
        self, make: Callable[[int, str, int], EngineLaunch], *, host: str, resources: dict[str, float] | None = None
    ) -> str:
        """Engine ``len(engines)`` on this host (``resources`` do not apply here), started without waiting."""
        index = len(self.engines)
        self._place_engine(index, resources)
        launch = make(index, *self.engine_address(index, host))
        launch.rebind = functools.partial(make, index)
        (url,) = self.start_engines([launch], timeout=0.0, wait=False)
        return url

    def _place_engine(self, index: int, resources: dict[str, float] | None) -> None:
        """Reserve what engine ``index`` (one more while the run goes on) needs; here nothing."""

    def engines_up(self) -> bool:
        """One look at the engines started without waiting (:meth:`wait_engines` without blocking; the health
        path asked with the run's API key, as there: SGLang's ``/health_generate`` needs it)."""
        import httpx

        pending = {p.name: (p, url) for p, url in self._starting}
        headers = self.keys.headers() if self.keys is not None else {}
        try:
            with httpx.Client(timeout=2.0, trust_env=False, headers=headers) as client:
                self._probe(pending, client)
        except BaseException:
            self._stop([p for p, _ in self._starting] + [p for p, _ in pending.values()])
            self._starting = []
            raise
        self._starting = [(p, url) for p, url in pending.values()]
        return not self._starting

    def retire_engine(self, url: str) -> None:
        """Terminate and reap the engine at ``url``; a reaped engine is no death (nothing restarts it)."""
        index = self.engine_urls.index(url.rstrip("/"))
        engine = self.engines[index]
        self._stop([engine])
        self._starting = [(p, u) for p, u in self._starting if p is not engine]
        log.info("%s (%s) was removed from the fleet and stopped", engine.name, url)

    def _note_progress(self, pending: dict[str, tuple[SupervisedProcess, str]], next_note: float) -> float:
        """Every ``progress_interval`` seconds, say which engines are still starting and what each is doing
        (its latest log line: loading weights, building the CPU kernels ...)."""
        now = time.monotonic()
        if now < next_note:
            return next_note
        for name, (process, _) in pending.items():
            last = next((line for line in reversed(process.log_tail(5).splitlines()) if line.strip()), "")
            log.info("%s is starting (%.0f s): %s", name, now - process.started_at, status_of(last) or "no output yet")
        return now + self.settings.progress_interval

    def start_trainers(self, specs: list[ProcessSpec]) -> None:
        running = [p.name for p in self.trainers if p.exit_status() is None]
        if running:
            raise LaunchError(f"trainer ranks still running: {', '.join(running)}")
        if any("MASTER_PORT" not in spec.env for spec in specs):
            self._rendezvous = RendezvousStore(specs[0].env.get("MASTER_ADDR", "127.0.0.1"))
            self._rendezvous.join(specs)
        trainers: list[SupervisedProcess] = []
        try:
            for rank, spec in enumerate(specs):
                trainers.append(self._start_member(spec, "trainer", rank))
        except BaseException:
            self._stop(trainers)
            raise
        self.trainers = trainers

    # -- waiting -----------------------------------------------------------------------------------
    def wait_trainers(self, *, timeout: float | None = None, tick: Callable[[], None] | None = None) -> int:
        if not self.trainers:
            raise LaunchError("wait_trainers: no trainer ranks were started")
        self._supervise(lambda: False, timeout=timeout, waiting_for="trainer ranks still running", tick=tick)
        for trainer in self.trainers:
            trainer.reap()
        log.info("all %d trainer ranks finished", len(self.trainers))
        return 0

    def wait_until(self, condition: Callable[[], bool], *, timeout: float, waiting_for: str) -> None:
        self._supervise(condition, timeout=timeout, waiting_for=waiting_for)

    def _supervise(
        self,
        condition: Callable[[], bool],
        *,
        timeout: float | None,
        waiting_for: str,
        tick: Callable[[], None] | None = None,
    ) -> None:
        """Watch the processes until ``condition()`` holds or every trainer rank finished: a rank that fails
        or ``timeout`` passing shuts everything down (:class:`LaunchError`); engine deaths go to
        :attr:`engine_deaths`; ``tick`` is called at every check (:meth:`wait_trainers`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if tick is not None:
                tick()
            for engine in list(self.engines):
                code = engine.exit_status()
                if code is not None and not engine.reaped:
                    self._engine_died(engine, code)
            codes = [trainer.exit_status() for trainer in self.trainers]
            if any(code not in (None, 0) for code in codes):
                raise self._trainers_failed(codes)
            if all(code is not None for code in codes) or condition():
                return
            if deadline is not None and time.monotonic() >= deadline:
                waiting = [t.name for t in self.trainers if t.exit_status() is None]
                raise self._abort(None, f"{waiting_for} ({', '.join(waiting)}) after {timeout:g} s", None)
            time.sleep(self.settings.poll_interval)

    def _trainers_failed(self, codes: list[int | None]) -> LaunchError:
        """Stop the run for failed trainer ranks (``codes``: each rank's exit status as first seen), naming its
        cause: a rank killed by a signal, seen within :attr:`~LocalLauncherSettings.failure_grace` seconds,
        over ranks that exited with an error (its peers, whose collectives failed with it), else the first
        failure seen (the lowest rank among those seen at once). The others are listed after it ("; after
        it, trainer rank 0 (trainer-0): exit code 1")."""
        failed = {rank: code for rank, code in enumerate(codes) if code is not None and code != 0}
        running = {rank for rank, code in enumerate(codes) if code is None}
        deadline = time.monotonic() + self.settings.failure_grace
        while running and not any(code < 0 for code in failed.values()) and time.monotonic() < deadline:
            time.sleep(self.settings.poll_interval)
            for rank in sorted(running):
                code = self.trainers[rank].exit_status()
                if code is not None:
                    running.discard(rank)
                    if code != 0:
                        failed[rank] = code  # dicts keep the order failures were seen in
        cause = next((rank for rank, code in failed.items() if code < 0), next(iter(failed)))
        trainer, code = self.trainers[cause], failed[cause]
        what = f"trainer rank {cause} ({trainer.name}) failed: {describe_exit(code)}"
        others = [
            f"trainer rank {rank} ({self.trainers[rank].name}): {describe_exit(other)}"
            for rank, other in failed.items()
            if rank != cause
        ]
        if others:
            what += f"; after it, {', '.join(others)}"
        return self._abort(trainer, what, code)

    def _engine_died(self, engine: SupervisedProcess, code: int) -> None:
        """An engine exited while the trainers ran: restart it (same command, same URL), leave it out or stop
        the run, as :attr:`engine_deaths` decides."""
        alive = [e.name for e in self.engines if e is not engine and e.exit_status() is None]
        decision = self.engine_deaths.decide(engine.name, f"exited ({describe_exit(code)})", alive=alive)
        if decision == "stop":
            raise self._abort(
                engine, f"{engine.name} exited ({describe_exit(code)}) while the trainers ran; no engine is left", code
            )
        engine.reap()
        if decision == "restart":
            index = self.engines.index(engine)
            self.engines[index] = self._start_engine(self._launches[engine.name], index)

    def _failure(self, process: SupervisedProcess | None, what: str, code: int | None) -> LaunchError:
        if process is None:
            return LaunchError(what)
        tail = process.log_tail(self.settings.log_tail_lines)
        message = (
            f"{what}; last lines of {process.log_path}:\n{tail}"
            if tail.strip()
            else f"{what} (its log {process.log_path} is empty)"
        )
        return LaunchError(message, process=process.name, returncode=code, log_tail=tail)

    def _abort(self, process: SupervisedProcess | None, what: str, code: int | None) -> LaunchError:
        error = self._failure(process, what + "; all other processes were terminated", code)
        log.error("%s", error)
        self.shutdown()
        return error

    # -- stopping ----------------------------------------------------------------------------------
    def _stop(self, processes: Sequence[SupervisedProcess]) -> None:
        """SIGTERM each group, wait up to ``terminate_timeout`` in all, SIGKILL the rest, reap all."""
        live = [p for p in processes if not p.reaped]
        for process in live:
            if process.exit_status() is None:
                process.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.terminate_timeout
        for process in live:
            if process.reap(timeout=max(0.0, deadline - time.monotonic())) is None:
                log.warning(
                    "%s (pid %d) ignored SIGTERM for %.0f s: SIGKILL",
                    process.name,
                    process.pid,
                    self.settings.terminate_timeout,
                )
                process.signal_group(signal.SIGKILL)
        for process in live:
            process.reap()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`shutdown` is running (a signal arriving now must not interrupt it)."""
        return self._stopping

    def shutdown(self) -> None:
        if self._stopped or self._stopping:
            return
        self._closed = True
        self._stopping = True
        try:
            # trainers first (they may still talk to the engines), then engines and helpers
            self._stop(self.trainers)
            self._stop(self.processes)
            self._rendezvous = None
            self._stopped = True
        finally:
            self._stopping = False
            if self._stopped:  # an interrupted shutdown stays tracked: the atexit hook finishes it
                cleanup.untrack(self)
