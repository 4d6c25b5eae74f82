"""What ``miles train`` does on the launching host: start engines and trainer ranks, follow progress,
tear everything down on exit, Ctrl-C or failure."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from miles.driver.loop import write_resolved_settings
from miles.driver.progress import follow_metrics
from miles.driver.rundir import prepare_run_dir

if TYPE_CHECKING:
    from rich.console import Console

    from miles.driver.run import Run
    from miles.launch.base import Launcher
    from miles.settings.model import MilesSettings

__all__ = ["launch_engines", "run_training"]

log = logging.getLogger(__name__)


def _child_env(settings: MilesSettings, *, role: str = "trainer") -> dict[str, str]:
    """Environment of a child process, with its torch thread count on CPU.

    In ``sync`` mode engines and trainer ranks take turns, so each side may use every core (the trainer
    ranks split them); in the async modes they run at once and every process gets its own share.
    ``OMP_NUM_THREADS`` / ``MILES_TORCH_THREADS`` set by the user win.
    """
    cores = os.cpu_count() or 1
    ranks, engines = settings.cluster.trainer_ranks, settings.cluster.num_engines
    if settings.rollout.mode == "sync":
        share = cores if role == "engine" else cores // ranks
    else:
        share = cores // max(ranks + engines, 1)
    threads = str(max(1, share))
    env = {
        "MILES_DEVICE": settings.cluster.device,
        "MILES_LOG_LEVEL": settings.log.level,
        "TOKENIZERS_PARALLELISM": "false",
    }
    if settings.cluster.device == "cpu":
        env.update(
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads),
            MILES_TORCH_THREADS=os.environ.get("MILES_TORCH_THREADS", threads),
        )
    return env


def launch_engines(run: Run, launcher: Launcher, *, model_path: str | None = None, wait: bool = True) -> list[str]:
    """Start ``cluster.num_engines`` engine servers serving the policy; return their URLs (``wait=False``:
    without waiting for them, see :meth:`Launcher.wait_engines`)."""
    from miles.launch.rendezvous import free_port

    settings = run.settings
    if settings.cluster.num_engines == 0:
        return []
    engine = run.rollout_engine()
    path = model_path or settings.train.model_path
    if path is None:
        from miles.errors import SettingsError

        raise SettingsError("train.model_path: not set (the engines and the trainer load it)")
    launches = []
    for i in range(settings.cluster.num_engines):
        launch = engine.launch(
            model_path=path,
            host=settings.cluster.host,
            port=free_port(settings.cluster.host),
            device=settings.cluster.device,
            dtype=run.engine_dtype,
            devices=[i] if settings.cluster.device == "cuda" else [],
        )
        launch.env = {**_child_env(settings, role="engine"), **launch.env}
        launches.append(launch)
    return launcher.start_engines(launches, timeout=settings.cluster.engine_startup_timeout, wait=wait)


def run_training(
    run: Run, *, resume: str | None = None, overwrite: bool = False, console: Console | None = None
) -> int:
    """Launch and supervise a training run; returns the exit code (0 on success).

    :param resume: continue from this checkpoint (a run directory that holds a run may be continued).
    :param overwrite: replace what an earlier run left in ``log.run_dir``; without it (or ``resume``) a
        run directory that holds a run is refused, so nothing an earlier run produced is lost.
    """
    from miles.launch.rendezvous import trainer_specs

    run_dir = prepare_run_dir(run.settings, resume=resume, overwrite=overwrite)
    run.materialize_model()
    settings = run.settings.model_copy(deep=True)
    settings.log.run_dir = str(run_dir)
    write_resolved_settings(settings, run_dir / "settings.json")
    with run.launcher(run_dir=str(run_dir)) as launcher:
        # the engines start (load weights, build the CPU kernels) while the trainer ranks load their models;
        # rank 0 waits for the engines' health before it talks to them
        urls = launch_engines(run, launcher, wait=False) if run.algorithm.needs.rollout else []
        (run_dir / "launch.json").write_text(json.dumps({"engine_urls": urls, "resume": resume}))
        env = _child_env(settings)
        specs = trainer_specs(
            [sys.executable, "-m", "miles.driver.worker", str(run_dir)], settings.cluster.trainer_ranks, env=env
        )
        launcher.start_trainers(specs)
        launcher.wait_engines(timeout=settings.cluster.engine_startup_timeout)
        with follow_metrics(console, run_dir / "metrics.jsonl", settings.train.num_rollouts):
            return launcher.wait_trainers()
