"""The synchronous RL loop, run SPMD by every trainer rank (rank 0 also drives rollout and logging).

One step: rank 0 generates and scores a rollout through the rollout manager; the groups are broadcast;
every rank computes the same advantages and trains on its share; all ranks push the new weights through
the transport; rank 0 verifies what the engines serve, logs metrics and saves checkpoints.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.driver import components
from miles.driver.batching import prepare_minibatches
from miles.driver.checkpoint import DriverState, checkpoint_dir, find_checkpoint, read_driver_state, write_driver_state
from miles.driver.comm import all_gather_json, broadcast_json
from miles.training.batch import TrainBatch
from miles.types import SampleGroup

if TYPE_CHECKING:
    from collections.abc import Iterator

    from miles.data.base import DataSource
    from miles.metrics.base import MetricsLogger
    from miles.plugins.manager import PluginManager
    from miles.rewards.scoring import NamedReward
    from miles.rollout.client import EngineClient
    from miles.rollout.manager import RolloutManager
    from miles.settings.model import MilesSettings
    from miles.training.trainer import DistContext
    from miles.transport.base import PushReport

__all__ = ["TrainingLoop"]

log = logging.getLogger(__name__)


def _mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in rows[0] if rows else []:
        values = [r[key] for r in rows if key in r]
        out[key] = sum(values) / len(values)
    return out


def mismatch_metrics(batches: list[TrainBatch]) -> dict[str, float]:
    """|trainer - rollout| logprob difference over trained tokens, before the step's updates, all ranks."""
    total = count = 0.0
    largest = 0.0
    for batch in batches:
        if batch.old_logprobs is None or batch.rollout_logprobs is None:
            return {}
        for old, rollout, mask in zip(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, strict=True):
            for a, b, m in zip(old, rollout, mask, strict=True):
                if m:
                    diff = abs(a - b)
                    total += diff
                    count += 1
                    largest = max(largest, diff)
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

    :param engine_urls: base URLs of the engines (rank 0 talks to them; empty for SFT).
    :param resume: a checkpoint to continue from (see :func:`find_checkpoint`).
    """

    def __init__(
        self,
        settings: MilesSettings,
        pm: PluginManager,
        dist: DistContext,
        *,
        engine_urls: list[str],
        resume: str | None = None,
    ) -> None:
        self.settings = settings
        self.pm = pm
        self.dist = dist
        self.engine_urls = engine_urls
        self.resume = resume
        self.run_dir = Path(settings.log.run_dir)
        self.ckpt_root = Path(settings.checkpoint.dir or self.run_dir / "checkpoints")
        self.is_driver = dist.rank == 0

        self.precision = components.build_precision(pm, settings)
        self.algorithm = components.build_algorithm(pm, settings)
        self.trainer = components.build_trainer(pm, settings, self.precision, dist)
        self.transport = components.build_transport(pm, settings, self.precision) if engine_urls else None
        self.client: EngineClient | None = None
        self.data: DataSource | None = None
        self.manager: RolloutManager | None = None
        self.rewards: list[NamedReward] = []
        self.tokenizer: Any = None
        self.loggers: list[MetricsLogger] = []
        self.step = 0
        self.weight_version = "0"

    # -- setup / teardown -------------------------------------------------------------------------
    async def setup(self) -> None:
        needs = self.algorithm.needs
        self.trainer.setup(need_ref=needs.ref_logprobs or needs.ref_logprobs_for_advantages, need_values=needs.values)
        if self.is_driver:
            await self._setup_driver()
        if self.transport is not None:
            self.transport.attach(self.trainer)
            await self.transport.connect(self.client, self.dist)
        if self.resume is not None:
            await self._load(find_checkpoint(self.resume))

    async def _setup_driver(self) -> None:
        from transformers import AutoTokenizer

        from miles.rewards.scoring import build_rewards, score_samples
        from miles.rollout.http_client import HttpEngineClient
        from miles.rollout.manager import RolloutManager

        settings = self.settings
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = tokenizer = AutoTokenizer.from_pretrained(settings.train.model_path)
        self.data = components.build_data_source(self.pm, settings, tokenizer=tokenizer)
        self.loggers = components.build_loggers(self.pm, settings)
        if not self.engine_urls:
            return
        self.client = HttpEngineClient(self.engine_urls)
        self.rewards = build_rewards(self.pm, settings.reward)
        rewards, reward_settings = self.rewards, settings.reward

        async def scorer(samples: Any) -> None:
            await score_samples(
                samples, rewards, timeout=reward_settings.timeout, max_concurrency=reward_settings.max_concurrency
            )

        self.manager = RolloutManager(
            self.client,
            settings.rollout,
            scorer=scorer,
            algorithm=self.algorithm,
            rollout_function=components.build_rollout_function(self.pm, settings),
            seed=settings.train.seed,
        )

    async def close(self) -> None:
        if self.transport is not None:
            await self.transport.close()
        if self.is_driver:
            from miles.rewards.scoring import close_rewards

            await close_rewards(self.rewards)
            if self.client is not None:
                await self.client.close()
            for logger in self.loggers:
                logger.close()
        self.trainer.close()

    # -- the loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        total = self.settings.train.num_rollouts
        if self.is_driver:
            log.info("training from step %d to %d", self.step, total)
        while self.step < total:
            await self.train_one_rollout()
            interval = self.settings.checkpoint.save_interval
            if interval is not None and self.step % interval == 0 and self.step < total:
                await self.save()
        if self.settings.checkpoint.save_final:
            await self.save()
        if self.settings.checkpoint.export_hf:
            self.trainer.export_hf(str(self.run_dir / "hf"))

    async def train_one_rollout(self) -> None:
        """One step: obtain groups (rank 0), broadcast, train, push weights, log."""
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        payload = await self.obtain_groups(metrics) if self.is_driver else None
        await self.engines_memory("release")
        groups = [SampleGroup.from_dict(g) for g in broadcast_json(payload)]
        metrics.update(await self.train_on(groups))
        self.step += 1
        await self.engines_memory("resume")
        report = await self.push_weights()
        if self.is_driver and self.settings.cluster.colocate and self.client is not None:
            await self.client.continue_generation()
        if self.is_driver:
            metrics.update(self._sync_metrics(report))
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

        start = time.perf_counter()
        metrics = await evaluate_once(
            self.pm,
            self.settings,
            self.client,
            tokenizer=self.tokenizer,
            rewards=self.rewards,
            rollout_function=components.build_rollout_function(self.pm, self.settings),
        )
        metrics["time/eval_seconds"] = time.perf_counter() - start
        return metrics

    async def engines_memory(self, action: str) -> None:
        """Colocated runs: engines free their KV cache and weights while the trainer trains (rank 0)."""
        if not (self.is_driver and self.settings.cluster.colocate and self.client is not None):
            return
        for url in self.client.urls:
            await self.client.call(url, f"/{action}_memory_occupation", {"tags": ["kv_cache", "weights"]})

    async def obtain_groups(self, metrics: dict[str, float]) -> list[dict[str, Any]]:
        """Rank 0: the groups of the next step, as JSON (rollout, or data rows for SFT); adds metrics."""
        settings = self.settings
        if not self.algorithm.needs.rollout:
            from miles.driver.sft import sft_groups

            assert self.data is not None
            batch_size = settings.rollout.rollout_batch_size
            prompts = self.data.next_batch(batch_size)
            sft = sft_groups(prompts, self.tokenizer, first_group_id=self.step * batch_size, weight_version=self.step)
            metrics["sft/response_tokens"] = float(sum(s.response_length for g in sft for s in g.samples))
            return [g.to_dict() for g in sft]
        assert self.manager is not None and self.data is not None
        result = await self.manager.rollout(self.data)
        metrics.update(result.metrics)
        self.record_rollout(result.groups, result.metrics)
        return [g.to_dict() for g in result.groups]

    def record_rollout(self, groups: list[SampleGroup], metrics: dict[str, float]) -> None:
        """Rank 0: keep the samples of the step on disk and tell the plugins."""
        self._dump_samples(groups)
        self.pm.on_rollout_end(step=self.step + 1, groups=groups, metrics=metrics)

    async def train_on(self, groups: list[SampleGroup]) -> dict[str, float]:
        """Every rank: advantages, this rank's share of each optimizer step, the steps; returns metrics."""
        settings = self.settings
        train_start = time.perf_counter()
        batches = prepare_minibatches(
            groups,
            algorithm=self.algorithm,
            trainer=self.trainer,
            dist=self.dist,
            global_batch_size=settings.train.global_batch_size or len(groups) * settings.rollout.n_samples_per_prompt,
            temperature=settings.rollout.temperature,
            on_policy=settings.rollout.mode == "sync",
        )
        metrics = mismatch_metrics(batches)  # before any update: the engine/trainer mismatch itself
        temperature = settings.rollout.temperature
        step_metrics = [self.trainer.train_step(batch, self.algorithm, temperature=temperature) for batch in batches]
        metrics.update({f"train/{k}": v for k, v in _mean_metrics(step_metrics).items()})
        if "fidelity/train_rollout_logprob_abs_diff" not in metrics and len(step_metrics) == 1:
            # old logprobs were skipped (one on-policy step): the step measured them before its update
            diff = step_metrics[0].get("train_rollout_logprob_abs_diff")
            if diff is not None:
                metrics["fidelity/train_rollout_logprob_abs_diff"] = diff
        metrics["time/train_seconds"] = time.perf_counter() - train_start
        return metrics

    def log_step(self, metrics: dict[str, float]) -> None:
        """Rank 0: fidelity warnings, loggers, lifecycle hooks."""
        self._check_fidelity(metrics)
        for logger in self.loggers:
            logger.log(self.step, metrics)
        self.pm.on_step_end(step=self.step, metrics=metrics)

    async def push_weights(self) -> PushReport | None:
        """Send the trainer's weights to the engines and verify them (rank 0 verifies)."""
        if self.transport is None:
            return None
        version = str(self.step)
        await self.randomize_engines(self.step)
        report = await self.transport.push(self.rollout_buckets(), version=version, dist=self.dist)
        self.weight_version = version
        await self.verify_push(report, step=self.step)
        return report

    def rollout_buckets(self) -> Iterator[list[tuple[str, Any]]]:
        """The trainer's weights in buckets, converted to what the engines serve (a collective: every rank)."""
        buckets = self.trainer.iter_weights(self.settings.transport.bucket_bytes)
        return ([*self.precision.rollout_weights(bucket)] for bucket in buckets)

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
        from miles.transport.verify import verify_engines

        assert self.transport is not None
        if self.settings.transport.verify:
            assert self.client is not None
            report.verification = await verify_engines(
                self.client,
                version=report.version,
                checksums_by_dtype={self.transport.engine_dtype: report.checksums},
            )
        self.pm.on_weights_pushed(step=step, version=report.version, report=report)

    def _sync_metrics(self, report: PushReport | None) -> dict[str, float]:
        if report is None:
            return {}
        out = {
            "weight_sync/seconds": report.seconds,
            "weight_sync/bytes": float(report.num_bytes),
            "weight_sync/tensors": float(report.num_tensors),
        }
        out.update(report.metrics)
        out.update(report.verification)
        return out

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
                extra=self.extra_state(),
            )
            write_driver_state(path, state)
            self.pm.on_checkpoint_saved(step=self.step, path=str(path))
            log.info("checkpoint saved: %s", path)

    def extra_state(self) -> dict[str, Any]:
        """Rank 0: more driver state to checkpoint (async modes: the buffer's contents)."""
        return {}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        """Rank 0: restore :meth:`extra_state`."""

    async def _load(self, path: Path) -> None:
        state = read_driver_state(path)
        self.trainer.load_checkpoint(str(path / "trainer"))
        self.step = state.step
        if self.is_driver:
            assert self.data is not None
            self.data.load_state_dict(state.data)
            if self.manager is not None and state.rollout:
                self.manager.load_state_dict(state.rollout)
            self.load_extra_state(state.extra)
            log.info("resumed from %s at step %d", path, state.step)
        # the engines start from the initial model: give them the checkpoint's weights
        await self.push_weights()


def write_resolved_settings(settings: MilesSettings, path: Path) -> None:
    """The resolved settings every rank reads (JSON: plugin tables keep their extra keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings.model_dump(mode="json"), indent=1))
