"""The RL loop, run SPMD by every trainer rank (rank 0 also drives rollout and logging).

One step: rank 0 takes the step's groups from the :class:`~miles.driver.sources.GroupSource`; the
groups are broadcast; every rank computes the same advantages and trains on its share; the
:class:`~miles.driver.publish.WeightPublisher` gets the new weights to the engines; rank 0 verifies what
they serve, logs metrics and saves checkpoints.

Every mode runs this one loop; the modes differ in its two seams, both chosen in :meth:`TrainingLoop.setup`:

- where groups come from — inline rollout (``sync``), data rows (SFT), or a producer filling a
  staleness buffer while the trainer trains (``one_step_off``, ``fully_async``);
- how weights are published — pushed and verified in line, or staged and committed while the next step
  trains (async modes with a staging transport and ``rollout.overlap_weight_commit``).

In the async modes training and staging run on a dedicated thread (:mod:`miles.driver.threads`), so rank
0's event loop keeps feeding the engines meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.driver.batching import prepare_minibatches
from miles.driver.checkpoint import (
    DriverState,
    checkpoint_dir,
    find_checkpoint,
    prune_checkpoints,
    read_driver_state,
    write_driver_state,
)
from miles.driver.colocate import LOADED_FILE, Colocation
from miles.driver.fidelity import mismatch_metrics, optimizer_step_metrics, scoring_temperature_of, warn_on_mismatch
from miles.driver.publish import WeightPublisher, make_publisher
from miles.driver.records import SampleRecords
from miles.driver.signals import SIGNAL_PROBE_TOKENS, SignalChecks, logprob_spread
from miles.driver.threads import ComputeThread
from miles.types import SampleGroup

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from miles.compose import Run
    from miles.data.base import DataSource
    from miles.driver.sources import GroupSource
    from miles.metrics.base import MetricsLogger
    from miles.rewards.scoring import RewardScorer
    from miles.rollout.client import EngineClient
    from miles.rollout.manager import RolloutManager
    from miles.rollout.router import EngineFleet
    from miles.settings.model import MilesSettings
    from miles.training.trainer import DistContext

__all__ = ["TrainingLoop", "run_to_completion"]

log = logging.getLogger(__name__)


class TrainingLoop:
    """Owns the components of one run on one rank.

    :param fleet: the engines and the router in front of them (rank 0 talks to them; ``None`` for SFT), or
        a coroutine function rank 0 awaits for them in :meth:`setup` (the launcher announces them once they
        answer, while the ranks load their models).
    :param resume: a checkpoint to continue from (see :func:`find_checkpoint`).
    """

    def __init__(
        self,
        run: Run,
        dist: DistContext,
        *,
        fleet: EngineFleet | Callable[[], Awaitable[EngineFleet]] | None = None,
        resume: str | None = None,
    ) -> None:
        settings = run.settings
        self.run_components = run
        self.settings: MilesSettings = settings
        self.pm = run.plugins
        self.dist = dist
        self.has_engines = fleet is not None
        """Whether the run has engines (every rank knows; only rank 0 talks to them)."""
        self.fleet: EngineFleet | None = None if callable(fleet) else fleet
        self._announced = fleet if callable(fleet) else None
        self.resume = resume
        self.run_dir = Path(settings.log.run_dir)
        self.ckpt_root = Path(settings.checkpoint.dir or self.run_dir / "checkpoints")
        self.is_driver = dist.rank == 0
        # before the trainer is built: the async modes train on a dedicated thread (miles.driver.threads)
        self.compute = ComputeThread(
            dedicated=settings.rollout.mode != "sync",
            cuda_device=dist.local_rank if dist.device == "cuda" else None,
        )

        self.precision = run.precision
        self.algorithm = run.algorithm
        self.trainer = run.trainer(dist)
        self.transport = run.transport() if self.has_engines else None
        self.publisher: WeightPublisher = make_publisher(self, run)
        self.colocation = Colocation(settings, self.trainer, engines=self.has_engines, is_driver=self.is_driver)
        self.publisher.colocation = self.colocation
        self.records = SampleRecords(self.run_dir, is_driver=self.is_driver)
        self.client: EngineClient | None = None
        self.data: DataSource | None = None
        self.manager: RolloutManager | None = None
        self.source: GroupSource | None = None
        self.scorer: RewardScorer | None = None
        self.tokenizer: Any = None
        self.loggers: list[MetricsLogger] = []
        self.follower: asyncio.Task[None] | None = None
        """Rank 0 of a launched run: follows engines joining and leaving (:class:`~miles.driver.fleet.FleetFollower`)."""
        self.signals = SignalChecks(settings.log.signals, vocab_size=None)
        """The signal checks (:mod:`miles.driver.signals`; rank 0 judges, every rank measures its batches)."""
        self._probe: list[int] = []
        self.step = 0
        self.completed = False
        """Whether :func:`run_to_completion` finished the run."""

    # -- setup / teardown -------------------------------------------------------------------------
    async def setup(self) -> None:
        needs = self.algorithm.needs
        self.trainer.setup(need_ref=needs.ref_logprobs or needs.ref_logprobs_for_advantages, need_values=needs.values)
        if self.resume is not None:
            self.trainer.load_checkpoint(str(find_checkpoint(self.resume) / "trainer"))
        if self.colocation.active:  # the trainer's memory goes before the engines start (they wait for it)
            self.colocation.after_load()
            if self.is_driver:
                (self.run_dir / LOADED_FILE).write_text("loaded\n")
        if self.is_driver:
            if self._announced is not None:  # the engines started while the ranks loaded their models
                self.fleet = await self._announced()
            self._setup_driver()
            self.colocation.client = self.client
            if self.client is not None:
                await self.client.wait_until_healthy(self.settings.cluster.engine_startup_timeout)
                if self._announced is not None:  # launched by miles train: the fleet may change (miles fleet)
                    self._follow_fleet()
                if self.publisher.waits_for_restarts:
                    self.client.wait_for_restarts(
                        restarts=self.settings.rollout.engine_restarts,
                        timeout=self.settings.cluster.engine_startup_timeout,
                    )
        await self.publisher.connect()
        if self.resume is not None:
            await self._load(find_checkpoint(self.resume))

    def _setup_driver(self) -> None:
        """Rank 0: data, loggers, and the group source of the mode (with the rollout stack when it rolls out)."""
        from miles.driver.sources import group_source_for

        run = self.run_components
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = run.tokenizer
        self.signals.vocab_size = len(self.tokenizer) if self.tokenizer is not None else None
        self.data = run.data_source(self.tokenizer)
        self.loggers = run.loggers()
        if self.fleet is not None:
            self.client = self.fleet.client()
            self.scorer = run.scorer()
            self.manager = run.rollout_manager(self.client, self.scorer)
        self.source = group_source_for(
            self.settings,
            data=self.data,
            tokenizer=self.tokenizer,
            manager=self.manager,
            client=self.client,
            needs_rollout=self.algorithm.needs.rollout,
        )

    def _follow_fleet(self) -> None:
        """Rank 0: a task that applies ``fleet.json``'s changes to the engine client (:mod:`miles.driver.fleet`)."""
        from miles.driver.fleet import FleetFollower
        from miles.rollout.http_client import HttpEngineClient

        if isinstance(self.client, HttpEngineClient):
            follower = FleetFollower(self.client, self.run_dir)
            self.follower = asyncio.create_task(follower.run(), name="fleet-follower")

    async def close(self) -> None:
        if self.follower is not None:
            self.follower.cancel()
            await asyncio.gather(self.follower, return_exceptions=True)
        try:
            if self.transport is not None:
                await self.transport.close()
            if self.is_driver:
                if self.scorer is not None:
                    await self.scorer.close()
                if self.manager is not None:
                    await self.manager.close()  # the rollout function's services (a session server)
                if self.client is not None:
                    await self.client.close()
                for logger in self.loggers:
                    logger.close()
            self.trainer.close()
        finally:
            self.compute.close()

    async def on_compute_thread(self, coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``coro_fn()`` where training runs (see :mod:`miles.driver.threads`)."""
        return await self.compute.run(coro_fn)

    # -- the loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        total = self.settings.train.num_rollouts
        await self.publisher.flush()  # a resumed run's first push: generate on the checkpoint's weights
        if self.is_driver and self.client is not None:
            await self.probe_signal()  # what the engines serve before the first step: the probe's baseline
        if self.source is not None:
            await self.source.start(self.step)
        if self.is_driver:
            log.info("training from step %d to %d", self.step, total)
        try:
            while self.step < total:
                await self.train_one_rollout()
                interval = self.settings.checkpoint.save_interval
                if interval is not None and self.step % interval == 0 and self.step < total:
                    await self.save()
            if self.settings.checkpoint.save_final:
                await self.save()
            if self.settings.checkpoint.export_hf:
                with self.colocation.trainer_back("the HF export"):
                    self.trainer.export_hf(str(self.run_dir / "hf"))
            await self.publisher.flush()
        finally:
            if self.source is not None:
                await self.source.stop()
            await self.publisher.close()

    async def train_one_rollout(self) -> None:
        """One step: obtain groups (rank 0), train (every rank), publish weights, log."""
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        # (a restarted engine takes the current weights while rank 0 waits for it to roll out)
        groups = await self.publisher.during_rollout(lambda: self.obtain_groups(metrics), metrics)
        await self.colocation.after_rollout()  # (colocated: the engines' memory goes, the trainer's comes back)
        metrics.update(await self.compute.run(lambda: self.train_on(groups)))
        self.step += 1
        report = await self.publisher.publish(self.step)  # (colocated: the phases around the push)
        if self.is_driver:
            metrics.update(self.publisher.metrics(report))
            if self.client is not None:
                metrics.update(self.client.failover_metrics())
                if report is not None:
                    metrics.update(await self.probe_signal())
            metrics["time/step_seconds"] = time.perf_counter() - start
            metrics.update(await self.maybe_evaluate())
            self.log_step(metrics)

    async def maybe_evaluate(self) -> dict[str, float]:
        """Rank 0: evaluation metrics when this step is an eval step (:func:`~miles.driver.evaluate.eval_due`)."""
        from miles.driver.evaluate import eval_due, evaluate_once

        if self.client is None or not eval_due(self.step, self.settings):
            return {}
        await self.publisher.flush()  # evaluate the version just published
        start = time.perf_counter()
        assert self.scorer is not None
        metrics = await evaluate_once(self.run_components, self.client, self.scorer, tokenizer=self.tokenizer)
        metrics["time/eval_seconds"] = time.perf_counter() - start
        return metrics

    async def obtain_groups(self, metrics: dict[str, float]) -> list[SampleGroup]:
        """Rank 0: the groups of the next step; adds metrics."""
        assert self.source is not None, "the run has neither engines nor a data-only algorithm"
        groups = await self.source.next_groups(self.step, metrics)
        if self.source.generates:  # kept on disk, and the plugins told
            self.records.rollout(self.step + 1, groups)
            self.pm.on_rollout_end(step=self.step + 1, groups=groups, metrics=metrics)
            if self.signals.active("reward_constant") or self.signals.active("reward_uncorrelated"):
                metrics.update(self.signals.reward_metrics(groups))
        return groups

    async def probe_signal(self) -> dict[str, float]:
        """Rank 0, after a push in line: the engines' logprobs of the probe sequence against the last push's
        (the ``probe_unchanged`` check; overlapped commits land after the step and are not probed)."""
        from miles.driver.publish import InlinePublisher
        from miles.transport.verify import PROBE_TEXT

        if not self.signals.active("probe_unchanged") or not isinstance(self.publisher, InlinePublisher):
            return {}
        if not self.run_components.engine_capabilities.token_logprobs:  # (an image engine: no text to probe)
            return {}
        assert self.client is not None
        if not self._probe:
            probe = self.publisher.probe or [int(t) for t in self.tokenizer.encode(PROBE_TEXT)]
            self._probe = probe[:SIGNAL_PROBE_TOKENS]
        return await self.signals.probe_metrics(self.client, self._probe)

    async def train_on(self, groups: list[SampleGroup] | None) -> dict[str, float]:
        """Every rank (``groups`` on rank 0): advantages, this rank's share of each optimizer step, the
        steps; returns metrics."""
        settings = self.settings
        train_start = time.perf_counter()
        assert settings.train.global_batch_size is not None  # derived by the settings
        temperature = scoring_temperature_of(settings)
        batches = prepare_minibatches(
            groups,
            algorithm=self.algorithm,
            trainer=self.trainer,
            dist=self.dist,
            global_batch_size=settings.train.global_batch_size,
            temperature=temperature,
            on_policy=settings.rollout.mode == "sync" and settings.log.trainer_logprobs != "always",
        )
        # before any update: the engine/trainer mismatch itself (the trainer holds weight version ``self.step``)
        metrics = mismatch_metrics(batches, self.step)
        if settings.log.signals.enabled:
            metrics.update(logprob_spread(batches))
        if settings.log.trainer_logprobs != "never":
            self.records.trainer_logprobs(self.step + 1, batches, groups)
        steps_start = time.perf_counter()
        step_metrics = [self.trainer.train_step(batch, self.algorithm, temperature=temperature) for batch in batches]
        steps_seconds = time.perf_counter() - steps_start
        metrics = {**optimizer_step_metrics(step_metrics), **metrics}
        metrics["time/train_seconds"] = time.perf_counter() - train_start
        metrics["time/train_step_seconds"] = steps_seconds  # the optimizer steps alone (without batch preparation)
        return metrics

    def log_step(self, metrics: dict[str, float]) -> None:
        """Rank 0: fidelity warnings and signal checks, loggers, lifecycle hooks; then a signal check that fired
        stops the run when ``log.signals.stop`` says so."""
        warn_on_mismatch(self.step, metrics, self.settings)
        fired = self.signals.judge(self.step, metrics)
        for logger in self.loggers:
            logger.log(self.step, metrics)
        self.pm.on_step_end(step=self.step, metrics=metrics)
        self.signals.stop_if_fired(self.step, fired)

    # -- checkpoints -------------------------------------------------------------------------------
    async def save(self) -> None:
        await self.publisher.flush()
        path = checkpoint_dir(self.ckpt_root, self.step)
        if (path / "driver.json").exists():  # the final save right after an interval save
            return
        with self.colocation.trainer_back("the checkpoint"):
            self.trainer.save_checkpoint(str(path / "trainer"))
        if self.is_driver:
            assert self.data is not None
            state = DriverState.capture(
                self.step, self.publisher.weight_version, data=self.data, manager=self.manager, source=self.source
            )
            write_driver_state(path, state)
            self.pm.on_checkpoint_saved(step=self.step, path=str(path))
            log.info("checkpoint saved: %s", path)
            if self.settings.checkpoint.keep_last is not None:
                prune_checkpoints(self.ckpt_root, self.settings.checkpoint.keep_last)

    async def _load(self, path: Path) -> None:
        """The driver's state of the checkpoint at ``path`` (the trainer loaded it in :meth:`setup`, before the
        engines started), and its weights pushed to the engines."""
        state = read_driver_state(path)
        self.step = state.step
        if self.is_driver:
            assert self.data is not None
            state.restore(data=self.data, manager=self.manager, source=self.source)
            log.info("resumed from %s at step %d", path, state.step)
        # the engines start from the initial model: give them the checkpoint's weights
        await self.publisher.publish(self.step)


async def run_to_completion(loop: TrainingLoop) -> None:
    """Set up, run and close ``loop`` on this rank, telling the plugins (rank 0) when the run starts and how
    it ended (``completed``, ``failed`` or ``interrupted``); the process group is left to the caller."""
    run_dir = str(loop.run_dir)
    status, error = "failed", None
    if loop.is_driver:
        loop.pm.on_run_start(settings=loop.settings, run_dir=run_dir)
    try:
        await loop.setup()
        await loop.run()
        status = "completed"
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        raise
    finally:
        try:
            await loop.close()
        finally:
            loop.completed = status == "completed"
            if loop.is_driver:
                loop.pm.on_run_end(run_dir=run_dir, status=status, error=error)
