"""``miles train --debug CONFIG``: the whole run in this one process, so ``breakpoint()`` and a debugger stop
anywhere — in a reward, an algorithm, a rollout function, the trainer, the engine.

The engine runs in-process (:meth:`~miles.rollout.backend.RolloutEngine.start_in_process` of the backend that
``rollout.engine`` selects: the local engine's scheduler and HTTP server on background threads), and
the training loop runs on the main thread as a world of one trainer rank (a gloo group of size 1). Same
components, same settings, same outputs in ``log.run_dir`` as a normal run; only the placement differs
(and the speed: one process shares one torch thread pool).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from miles.errors import SettingsError
from miles.host.rundir import prepare_run_dir

if TYPE_CHECKING:
    from miles.compose import Run

__all__ = ["run_debug"]

log = logging.getLogger(__name__)


def _check(run: Run) -> None:
    s = run.settings
    if s.cluster.trainer_ranks != 1:
        raise SettingsError(
            f"cluster.trainer_ranks: --debug runs one trainer rank in this process (it is {s.cluster.trainer_ranks}); "
            "set cluster.trainer_ranks = 1"
        )
    if s.cluster.num_engines > 1:
        raise SettingsError(
            f"cluster.num_engines: --debug runs one engine in this process (it is {s.cluster.num_engines})"
        )
    engine = run["rollout.engine"].registration
    if run.algorithm.needs.rollout and not engine.component.capabilities.in_process:
        raise SettingsError(
            f"rollout.engine: --debug runs the engine in this process, which engine {engine.name!r} cannot "
            "(the local engine can; not a server fleet)"
        )
    for i in range(len(s.reward.functions)):
        resolved = run.resolved.get(f"reward.functions[{i}]")
        if resolved is not None and resolved.create().server() is not None:
            raise SettingsError(
                f"reward.functions[{i}]: --debug starts no other process, and this reward needs its own server "
                "(a reward model): start one and set its url"
            )
    if s.cluster.device != "cpu":
        log.info("--debug on %s: the engine and the trainer share the device", s.cluster.device)


async def _train(run: Run, urls: list[str], resume: str | None) -> None:
    import torch.distributed as dist

    from miles.driver.loop import TrainingLoop, run_to_completion
    from miles.rollout.router import EngineFleet
    from miles.training.trainer import DistContext

    # a world of one: its store lives in this process (no port)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    fleet = EngineFleet(urls) if urls else None
    loop = TrainingLoop(run, DistContext(device=run.settings.cluster.device), fleet=fleet, resume=resume)
    try:
        await run_to_completion(loop)
    finally:
        dist.destroy_process_group()


def run_debug(run: Run, *, resume: str | None = None, overwrite: bool = False) -> int:
    """Run training with the engine and the trainer in this process; returns 0 (errors raise)."""
    from miles.host.rundir import write_resolved_settings
    from miles.host.train import allowed_weight_dirs

    _check(run)
    run_dir = prepare_run_dir(run.settings, resume=resume, overwrite=overwrite)
    model_path = run.materialize_model()
    run.settings.log.run_dir = str(run_dir)
    write_resolved_settings(run.settings, run_dir / "settings.json")
    settings = run.settings
    if not (run.algorithm.needs.rollout and settings.cluster.num_engines):
        asyncio.run(_train(run, [], resume))
        return 0
    serving = run.rollout_engine().start_in_process(
        model_path=model_path,
        host=settings.cluster.host,
        device=settings.cluster.device,
        dtype=run.engine_dtype,
        allowed_weight_dirs=allowed_weight_dirs(run),
    )
    with serving as url:
        asyncio.run(_train(run, [url], resume))
    return 0
