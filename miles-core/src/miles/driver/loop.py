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

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.driver.batching import prepare_minibatches
from miles.driver.checkpoint import DriverState, checkpoint_dir, find_checkpoint, read_driver_state, write_driver_state
from miles.driver.publish import InlinePublisher, OverlappedPublisher, WeightPublisher
from miles.driver.threads import ComputeThread
from miles.training.batch import TrainBatch
from miles.training.comm import all_gather_json
from miles.transport.base import StagedTransport
from miles.types import SampleGroup

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

    from miles.data.base import DataSource
    from miles.driver.run import Run
    from miles.driver.sources import GroupSource
    from miles.metrics.base import MetricsLogger
    from miles.rewards.scoring import RewardScorer
    from miles.rollout.client import EngineClient
    from miles.rollout.manager import RolloutManager
    from miles.rollout.router import EngineFleet
    from miles.settings.model import MilesSettings
    from miles.training.trainer import DistContext
    from miles.transport.verify import WeightSampler
    from miles.types import PushReport

__all__ = ["TrainingLoop", "run_to_completion"]

log = logging.getLogger(__name__)


def _mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in rows[0] if rows else []:
        values = [r[key] for r in rows if key in r]
        out[key] = sum(values) / len(values)
    return out


def scoring_temperature_of(settings: MilesSettings) -> float:
    """The temperature of the distribution the engines report logprobs of (what the trainer scores at): the
    sampling temperature, or 1 for greedy decoding and engines reporting the raw logits' logprobs."""
    from miles.training.logprobs import scoring_temperature

    rollout = settings.rollout
    original = bool(rollout.engine.options.get("return_original_logprob", False))
    return scoring_temperature(rollout.temperature, top_k=rollout.top_k, original_logprobs=original)


def mismatch_metrics(batches: list[TrainBatch]) -> dict[str, float]:
    """|trainer - rollout| logprob difference over trained tokens, before the step's updates, all ranks."""
    total = count = largest = 0.0
    for batch in batches:
        if batch.old_logprobs is None or batch.rollout_logprobs is None:
            return {}
        trained = batch.loss_mask != 0
        diff = (batch.old_logprobs.double() - batch.rollout_logprobs.double()).abs()[trained]
        total += float(diff.sum())
        count += float(diff.numel())
        largest = max(largest, float(diff.max())) if diff.numel() else largest
    parts = all_gather_json([total, count, largest])
    tokens = sum(p[1] for p in parts)
    if not tokens:
        return {}
    return {
        "fidelity/train_rollout_logprob_abs_diff": sum(p[0] for p in parts) / tokens,
        "fidelity/train_rollout_logprob_abs_diff_max": max(p[2] for p in parts),
    }


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
        self.compute = ComputeThread(dedicated=settings.rollout.mode != "sync")

        self.precision = run.precision
        self.algorithm = run.algorithm
        self.trainer = run.trainer(dist)
        self.transport = run.transport() if self.has_engines else None
        self.sampler: WeightSampler | None = None
        """Rank 0, engines without a checksum route: samples each push for :func:`verify_sampled`."""
        if self.transport is not None and settings.transport.verify and not run.engine_capabilities.weights_checksum:
            from miles.transport.verify import WeightSampler

            self.sampler = WeightSampler(self.transport.engine_dtype)
        self.publisher: WeightPublisher = (
            OverlappedPublisher(self) if self._overlaps_commit() else InlinePublisher(self)
        )
        self.client: EngineClient | None = None
        self.data: DataSource | None = None
        self.manager: RolloutManager | None = None
        self.source: GroupSource | None = None
        self.scorer: RewardScorer | None = None
        self.tokenizer: Any = None
        self.loggers: list[MetricsLogger] = []
        self.step = 0
        self.completed = False
        """Whether :func:`run_to_completion` finished the run."""

    def _overlaps_commit(self) -> bool:
        """Whether pushes are staged and committed while the next step trains (the same on every rank)."""
        s = self.settings
        return (
            s.rollout.mode != "sync"
            and isinstance(self.transport, StagedTransport)
            and s.rollout.overlap_weight_commit
            and self.algorithm.needs.rollout
            and not s.cluster.colocate
        )

    @property
    def weight_version(self) -> str:
        """The version the trainer's weights were last published as."""
        return self.publisher.weight_version

    # -- setup / teardown -------------------------------------------------------------------------
    async def setup(self) -> None:
        needs = self.algorithm.needs
        self.trainer.setup(need_ref=needs.ref_logprobs or needs.ref_logprobs_for_advantages, need_values=needs.values)
        if self.is_driver:
            if self._announced is not None:  # the engines started while the ranks loaded their models
                self.fleet = await self._announced()
            self._setup_driver()
            if self.client is not None:
                await self.client.wait_until_healthy(self.settings.cluster.engine_startup_timeout)
                if self.waits_for_restarts:
                    self.client.wait_for_restarts(
                        restarts=self.settings.rollout.engine_restarts,
                        timeout=self.settings.cluster.engine_startup_timeout,
                    )
        await self.publisher.connect()
        if self.resume is not None:
            await self._load(find_checkpoint(self.resume))

    def _setup_driver(self) -> None:
        """Rank 0: data, loggers, and the group source of the mode (with the rollout stack when it rolls out)."""
        from miles.driver.sources import BufferedRollout, InlineRollout, SFTBatches

        run, settings = self.run_components, self.settings
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = run.tokenizer
        self.data = run.data_source(self.tokenizer)
        self.loggers = run.loggers()
        if not self.algorithm.needs.rollout:
            self.source = SFTBatches(self.data, self.tokenizer, batch_size=settings.rollout.rollout_batch_size)
        if self.fleet is None:
            return
        self.client = self.fleet.client()
        self.scorer = run.scorer()
        self.manager = run.rollout_manager(self.client, self.scorer)
        if self.source is not None:
            return
        if settings.rollout.mode == "sync":
            self.source = InlineRollout(self.manager, self.data)
        else:
            from miles.rollout.producer import buffer_for

            buffer = buffer_for(settings.rollout, num_rollouts=settings.train.num_rollouts)
            self.source = BufferedRollout(self.manager, self.data, buffer, self.client, mode=settings.rollout.mode)

    async def close(self) -> None:
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
        groups = await self.obtain_groups_or_republish(metrics)
        await self.engines_memory("release")
        metrics.update(await self.compute.run(lambda: self.train_on(groups)))
        self.step += 1
        await self.engines_memory("resume")
        report = await self.publisher.publish(self.step)
        if self.is_driver and self.settings.cluster.colocate and self.client is not None:
            await self.client.continue_generation()
        if self.is_driver:
            metrics.update(self.publisher.metrics(report))
            if self.client is not None:
                metrics.update(self.client.failover_metrics())
            metrics["time/step_seconds"] = time.perf_counter() - start
            metrics.update(await self.maybe_evaluate())
            self.log_step(metrics)

    async def maybe_evaluate(self) -> dict[str, float]:
        """Rank 0: evaluation metrics when this step is an eval step (every ``train.eval_interval`` and the last)."""
        interval = self.settings.train.eval_interval
        if interval is None or self.client is None:
            return {}
        if self.step % interval and self.step != self.settings.train.num_rollouts:
            return {}
        from miles.driver.evaluate import evaluate_once

        await self.publisher.flush()  # evaluate the version just published
        start = time.perf_counter()
        assert self.scorer is not None
        metrics = await evaluate_once(self.run_components, self.client, self.scorer, tokenizer=self.tokenizer)
        metrics["time/eval_seconds"] = time.perf_counter() - start
        return metrics

    async def engines_memory(self, action: str) -> None:
        """Colocated runs: engines free their KV cache and weights while the trainer trains (rank 0)."""
        if not (self.is_driver and self.settings.cluster.colocate and self.client is not None):
            return
        for url in self.client.urls:
            await self.client.call(url, f"/{action}_memory_occupation", {"tags": ["kv_cache", "weights"]})

    @property
    def waits_for_restarts(self) -> bool:
        """Whether a rollout that loses every engine waits for a restarted one (the same on every rank):
        ``sync`` runs that roll out through a transport, with ``rollout.engine_restarts`` and no router (it
        would send traffic to a restarted engine before it has the weights)."""
        rollout = self.settings.rollout
        return (
            rollout.mode == "sync"
            and rollout.engine_restarts > 0
            and rollout.router.name != "smg"
            and self.transport is not None
            and self.algorithm.needs.rollout
        )

    async def obtain_groups_or_republish(self, metrics: dict[str, float]) -> list[SampleGroup] | None:
        """Every rank: rank 0 obtains the step's groups (:meth:`obtain_groups`; ``None`` on the others).

        When the rollout loses every engine and one may be restarted (:attr:`waits_for_restarts`), generation
        waits (:meth:`~miles.rollout.client.EngineClient.wait_for_restarts`); rank 0 probes the engines
        meanwhile, and once a restarted one answers, every rank takes part in pushing it the trainer's
        current weights (:meth:`~miles.driver.publish.WeightPublisher.republish`, a push is a collective),
        after which it serves and the rollout goes on."""
        import asyncio

        from miles.training.comm import broadcast_json

        if not self.waits_for_restarts:
            return await self.obtain_groups(metrics) if self.is_driver else None
        if not self.is_driver:
            while broadcast_json(None) == "republish":
                await self.publisher.republish()
            return None
        client = self.client
        assert client is not None
        rollout = asyncio.ensure_future(self.obtain_groups(metrics))
        pushes = 0
        try:
            while not (await asyncio.wait({rollout}, timeout=1.0))[0]:
                if client.serving() or not await client.check_engines():
                    continue
                log.warning("pushing weight version %s to %s", self.weight_version, ", ".join(client.rejoining()))
                broadcast_json("republish")
                await self.publisher.republish()
                pushes += 1
        except BaseException:
            rollout.cancel()
            raise
        groups = rollout.result()  # (a failed rollout ends the run: the launcher stops the other ranks)
        broadcast_json("groups")
        if pushes:
            metrics["weight_sync/rejoin_pushes"] = float(pushes)
        return groups

    async def obtain_groups(self, metrics: dict[str, float]) -> list[SampleGroup]:
        """Rank 0: the groups of the next step; adds metrics."""
        assert self.source is not None, "the run has neither engines nor a data-only algorithm"
        groups = await self.source.next_groups(self.step, metrics)
        if self.source.generates:
            self.record_rollout(groups, metrics)
        return groups

    def record_rollout(self, groups: list[SampleGroup], metrics: dict[str, float]) -> None:
        """Rank 0: keep the samples of the step on disk and tell the plugins."""
        self._dump_samples(groups)
        self.pm.on_rollout_end(step=self.step + 1, groups=groups, metrics=metrics)

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
        metrics = mismatch_metrics(batches)  # before any update: the engine/trainer mismatch itself
        if settings.log.trainer_logprobs != "never":
            self.record_trainer_logprobs(batches, groups)
        steps_start = time.perf_counter()
        step_metrics = [self.trainer.train_step(batch, self.algorithm, temperature=temperature) for batch in batches]
        steps_seconds = time.perf_counter() - steps_start
        # the trainer's fidelity signals (routing agreement) keep their own prefix
        metrics.update(
            {k if k.startswith("fidelity/") else f"train/{k}": v for k, v in _mean_metrics(step_metrics).items()}
        )
        if "fidelity/train_rollout_logprob_abs_diff" not in metrics and len(step_metrics) == 1:
            # old logprobs were skipped (one on-policy step): the step measured them before its update
            diff = step_metrics[0].get("train_rollout_logprob_abs_diff")
            if diff is not None:
                metrics["fidelity/train_rollout_logprob_abs_diff"] = diff
        metrics["time/train_seconds"] = time.perf_counter() - train_start
        metrics["time/train_step_seconds"] = steps_seconds  # the optimizer steps alone (without batch preparation)
        return metrics

    def record_trainer_logprobs(self, batches: list[TrainBatch], groups: list[SampleGroup] | None) -> None:
        """Every rank (a collective): the trainer's logprobs of each sample before the step's update, written
        by rank 0 beside the step's samples (``samples/trainer_logprobs_<step>.jsonl``); nothing when the
        step did not compute them."""
        import torch

        from miles.training.comm import all_gather_tensors

        if not batches or any(b.old_logprobs is None for b in batches):
            return
        rows: list[Any] = []
        for batch in batches:  # each step's share per rank, in rank order: the samples' order
            assert batch.old_logprobs is not None
            local = {"logprobs": batch.old_logprobs, "lengths": torch.tensor(batch.response_lengths)}
            for part in all_gather_tensors(local):
                rows.extend(part["logprobs"].split(part["lengths"].tolist()))
        if not self.is_driver or groups is None:
            return
        samples = [s for g in groups for s in g.samples]
        folder = self.run_dir / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"trainer_logprobs_{self.step + 1:06d}.jsonl", "w", encoding="utf-8") as f:
            for sample, row in zip(samples, rows, strict=True):
                record = {"group_id": sample.group_id, "index": sample.index, "logprobs": row.tolist()}
                f.write(json.dumps(record) + "\n")

    def log_step(self, metrics: dict[str, float]) -> None:
        """Rank 0: fidelity warnings, loggers, lifecycle hooks."""
        self._check_fidelity(metrics)
        for logger in self.loggers:
            logger.log(self.step, metrics)
        self.pm.on_step_end(step=self.step, metrics=metrics)

    def rollout_buckets(self) -> Iterator[list[tuple[str, Any]]]:
        """The trainer's weights in buckets, converted to what the engines serve (a collective: every rank)."""
        buckets = self.trainer.iter_weights(self.settings.transport.bucket_bytes)
        converted = ([*self.precision.rollout_weights(bucket)] for bucket in buckets)
        if self.sampler is not None and self.is_driver:
            return self.sampler.observe(converted)
        return converted

    async def randomize_engines(self, step: int) -> None:
        """Test mode ``transport.randomize_engines_first``: random engine weights before a push (rank 0)."""
        if self.is_driver and self.settings.transport.randomize_engines_first:
            assert self.client is not None
            for url in self.client.urls:
                await self.client.call(url, "/debug/randomize_weights", {"seed": step})

    async def verify_push(self, report: PushReport, *, step: int) -> None:
        """Rank 0: check the engines serve what was pushed (``transport.verify``); tell the plugins."""
        if not self.is_driver:
            return
        from miles.transport.verify import verify_engines, verify_sampled

        assert self.transport is not None
        own = None
        if self.settings.transport.verify:
            assert self.client is not None
            own = await self.transport.verify(self.client, report)
        if own is not None:
            report.verification = own
        elif self.settings.transport.verify and self.sampler is not None:
            assert self.client is not None
            report.verification = await verify_sampled(
                self.client, version=report.version, samples=self.sampler.samples
            )
        elif self.settings.transport.verify:
            assert self.client is not None
            report.verification = await verify_engines(
                self.client,
                version=report.version,
                checksums_by_dtype={self.transport.engine_dtype: report.checksums},
            )
        self.pm.on_weights_pushed(step=step, version=report.version, report=report)

    def _check_fidelity(self, metrics: dict[str, float]) -> None:
        diff = metrics.get("fidelity/train_rollout_logprob_abs_diff")
        threshold = self.settings.log.logprob_diff_warn
        if diff is not None and diff > threshold:
            log.warning("step %d: |train - rollout| logprob difference %.4f exceeds %.4f", self.step, diff, threshold)

    def _dump_samples(self, groups: list[SampleGroup]) -> None:
        folder = self.run_dir / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rollout_{self.step + 1:06d}.jsonl", "w", encoding="utf-8") as f:
            for group in groups:
                for sample in group.samples:
                    f.write(sample.to_json() + "\n")

    # -- checkpoints -------------------------------------------------------------------------------
    async def save(self) -> None:
        await self.publisher.flush()
        path = checkpoint_dir(self.ckpt_root, self.step)
        if (path / "driver.json").exists():  # the final save right after an interval save
            return
        self.trainer.save_checkpoint(str(path / "trainer"))
        if self.is_driver:
            assert self.data is not None
            state = DriverState(
                step=self.step,
                weight_version=self.weight_version,
                data=self.data.state_dict(),
                rollout=self.manager.state_dict() if self.manager is not None else {},
                extra=self.source.state_dict() if self.source is not None else {},
            )
            write_driver_state(path, state)
            self.pm.on_checkpoint_saved(step=self.step, path=str(path))
            log.info("checkpoint saved: %s", path)

    async def _load(self, path: Path) -> None:
        state = read_driver_state(path)
        self.trainer.load_checkpoint(str(path / "trainer"))
        self.step = state.step
        if self.is_driver:
            assert self.data is not None
            self.data.load_state_dict(state.data)
            if self.manager is not None and state.rollout:
                self.manager.load_state_dict(state.rollout)
            if self.source is not None:
                self.source.load_state_dict(state.extra, step=state.step)
            log.info("resumed from %s at step %d", path, state.step)
        # the engines start from the initial model: give them the checkpoint's weights
        await self.publisher.publish(self.step)


def write_resolved_settings(settings: MilesSettings, path: Path) -> None:
    """The resolved settings every rank reads (JSON: plugin tables keep their extra keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings.model_dump(mode="json"), indent=1))


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
