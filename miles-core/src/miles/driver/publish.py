"""How the trainer's weights reach the engines after each step: the training loop's second seam.

- :class:`InlinePublisher`: every rank pushes through the transport, rank 0 verifies, and the step goes
  on when the engines serve the new version. While the group source produces (async modes) the engines
  are paused around the push (``rollout.pause_mode``) and verified once they generate again (a paused
  engine holds the logprob probe, a generation). When engines die during the push and others are
  left, the whole version is pushed again to those (every rank takes part: the buckets are collectives).
- :class:`OverlappedPublisher`: async modes with a :class:`~miles.transport.base.StagedTransport` and
  ``rollout.overlap_weight_commit``: every rank *stages* version ``k`` (rank 0 snapshots the gathered
  weights in host memory, so the next step may change them), and a task on rank 0's event loop
  *commits* it — writes it while the engines keep generating, pauses, has the engines load it, continues,
  verifies — while the trainer already trains step ``k + 1``. Only the snapshot stays on the trainer's
  critical path. Commits run one at a time, in order; the next push, an evaluation, a checkpoint and the
  end of the run wait for the pending one (:meth:`WeightPublisher.flush`), so a verification failure stops
  the run at the latest one step later, with the tensor's name. When engines die during a commit and
  others are left, the version (still staged) is committed again to those; the engines stay paused until
  it is in. The group source learns version ``k`` when
  it is staged (the trainer holds it from then on) and that the engines serve it when the commit has
  loaded it: the staleness window follows the engines' version.

The other seam, where groups come from, is :mod:`miles.driver.sources`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from miles.errors import EngineError
from miles.rollout.protocol import LAUNCH_WEIGHT_VERSION
from miles.transport.base import StagedTransport

if TYPE_CHECKING:
    from miles.compose import Run
    from miles.driver.colocate import Colocation
    from miles.driver.sources import GroupSource
    from miles.plugins.manager import PluginManager
    from miles.precision.base import PrecisionRecipe
    from miles.rollout.client import EngineClient
    from miles.settings.model import MilesSettings
    from miles.training.trainer import DistContext, Trainer
    from miles.transport.base import WeightTransport
    from miles.transport.verify import WeightSampler
    from miles.types import PushReport, SampleGroup

__all__ = ["InlinePublisher", "OverlappedPublisher", "PublishContext", "WeightPublisher", "make_publisher"]

log = logging.getLogger(__name__)


class PublishContext(Protocol):
    """What a publisher needs from the training loop: the components of the run on this rank, and rank 0's
    engine client and group source (set up by :meth:`TrainingLoop.setup`)."""

    settings: MilesSettings
    dist: DistContext
    trainer: Trainer
    precision: PrecisionRecipe
    transport: WeightTransport | None
    client: EngineClient | None
    source: GroupSource | None
    pm: PluginManager
    tokenizer: Any

    async def on_compute_thread(self, coro_fn: Callable[[], Awaitable[Any]]) -> Any: ...


class WeightPublisher(ABC):
    """Publishes each step's weights (every rank calls it, in step): the one way weights leave the trainer.

    The trainer's weights go out as HF-named buckets (:meth:`buckets`: the trainer's ``iter_weights``, the
    precision recipe's conversion), the transport moves them, and rank 0 verifies what the engines serve
    (:meth:`verify`) and tells the plugins (``miles_on_weights_pushed``).

    :param sample_pushes: rank 0 keeps the first rows of every tensor of a push for a sampled verification
        (engines without a checksum route, such as SGLang); decided by the composition root from the
        engine's capabilities.
    """

    def __init__(self, loop: PublishContext, *, sample_pushes: bool = False) -> None:
        self.loop = loop
        self.weight_version = LAUNCH_WEIGHT_VERSION
        """The version the trainer's weights were last published as."""
        settings = loop.settings
        self.verification = settings.transport.verify_with
        """How pushes are verified (``auto`` until :meth:`connect` decides; the same on every rank)."""
        if self.verification == "auto" and not sample_pushes:
            self.verification = "checksums"
        self.sampler: WeightSampler | None = None
        """Rank 0, ``rows`` verification: samples each push for :func:`verify_sampled`."""
        if loop.transport is not None and settings.transport.verify and self.verification in ("auto", "rows"):
            from miles.transport.verify import WeightSampler

            self.sampler = WeightSampler(loop.transport.engine_dtype)
        self.probe: list[int] = []
        """``logprobs`` verification: the probe's tokens (:data:`~miles.transport.verify.PROBE_TEXT`)."""
        self._probe_expected: dict[str, list[float]] = {}
        """Rank 0: the trainer's logprobs of the probe, by the version they were computed for."""
        self.colocation: Colocation | None = None
        """A colocated run's phases around each push (:mod:`miles.driver.colocate`; set by the loop)."""

    @property
    def is_driver(self) -> bool:
        return self.loop.dist.rank == 0

    async def connect(self) -> None:
        """Once, on every rank, before the first push: give the transport this rank's trainer
        (:meth:`~miles.transport.base.WeightTransport.attach`) and connect it to the engines."""
        loop = self.loop
        if loop.transport is not None:
            loop.transport.attach(loop.trainer)
            await loop.transport.connect(loop.client, loop.dist)
            if loop.settings.transport.verify:
                await self._choose_verification()

    async def _choose_verification(self) -> None:
        """Every rank: settle :attr:`verification` (``auto``: rows where every engine answers
        ``/get_weights_by_name`` with the checkpoint's own rows, else logprobs) and the probe, as rank 0 finds."""
        from miles.training.comm import broadcast_json
        from miles.transport.verify import PROBE_TEXT, reference_rows, rows_problem

        loop = self.loop
        decided: dict[str, Any] | None = None
        if self.is_driver:
            method = self.verification
            if method == "auto":
                assert loop.client is not None and loop.transport is not None
                reference = reference_rows(loop.settings.train.model_path, loop.transport.engine_dtype)
                problem = await rows_problem(loop.client, reference)
                method = "rows" if problem is None else "logprobs"
                if problem is not None:
                    log.info(
                        "sampled rows cannot verify pushes to these engines (%s): each push is verified by their "
                        "logprobs of a probe sequence (transport.verify_with = 'logprobs')",
                        problem,
                    )
            probe = [int(t) for t in loop.tokenizer.encode(PROBE_TEXT)] if method == "logprobs" else []
            decided = {"method": method, "probe": probe}
        decided = broadcast_json(decided)
        assert decided is not None
        self.verification, self.probe = decided["method"], list(decided["probe"])
        if self.verification != "rows":
            self.sampler = None

    def probe_expected(self, version: str) -> None:
        """Every rank (a forward of the trainer: a collective), ``logprobs`` verification: the trainer's
        logprobs of the probe under the weights published as ``version``, kept by rank 0 for :meth:`verify`."""
        if self.verification != "logprobs" or not self.loop.settings.transport.verify:
            return
        from miles.training.batch import TrainBatch
        from miles.types import Sample

        probe = self.probe
        n = len(probe) - 1
        sample = Sample(prompt_ids=probe[:1], response_ids=probe[1:], rollout_logprobs=[0.0] * n, loss_mask=[1] * n)
        out = self.loop.trainer.compute_logprobs(TrainBatch.from_samples([sample]), temperature=1.0)
        if self.is_driver:
            self._probe_expected = {version: [float(v) for v in out.logprobs.tolist()]}  # its one sequence

    @abstractmethod
    async def publish(self, step: int) -> PushReport | None:
        """Publish the trainer's weights as version ``step`` (``None`` without a transport)."""

    @property
    def waits_for_restarts(self) -> bool:
        """Whether a rollout that loses every engine waits for a restarted one (the same on every rank):
        ``sync`` runs that roll out through a transport, with ``rollout.engine_restarts`` and no router (it
        would send traffic to a restarted engine before it has the weights)."""
        rollout = self.loop.settings.rollout
        return (
            rollout.mode == "sync"
            and rollout.engine_restarts > 0
            and rollout.router.name != "smg"
            and self.loop.transport is not None
        )

    async def during_rollout(
        self, rollout: Callable[[], Awaitable[list[SampleGroup]]], metrics: dict[str, float]
    ) -> list[SampleGroup] | None:
        """Every rank: rank 0 awaits ``rollout()`` (the step's groups; ``None`` on the others).

        When the rollout loses every engine and one may be restarted (:attr:`waits_for_restarts`), generation
        waits (:meth:`~miles.rollout.client.EngineClient.wait_for_restarts`); rank 0 probes the engines
        meanwhile, and once a restarted one answers, every rank takes part in pushing it the trainer's
        current weights (:meth:`republish`, a push is a collective), after which it serves and the rollout
        goes on."""
        from miles.training.comm import broadcast_json

        if not self.waits_for_restarts:
            return await rollout() if self.is_driver else None
        if not self.is_driver:
            while broadcast_json(None) == "republish":
                await self.republish()
            return None
        client = self.loop.client
        assert client is not None
        task = asyncio.ensure_future(rollout())
        pushes = 0
        try:
            while not (await asyncio.wait({task}, timeout=1.0))[0]:
                if client.serving() or not await client.check_engines():
                    continue
                log.warning("pushing weight version %s to %s", self.weight_version, ", ".join(client.rejoining()))
                broadcast_json("republish")
                await self.republish()
                pushes += 1
        except BaseException:
            task.cancel()
            raise
        groups = task.result()  # (a failed rollout ends the run: the launcher stops the other ranks)
        broadcast_json("groups")
        if pushes:
            metrics["weight_sync/rejoin_pushes"] = float(pushes)
        return groups

    async def republish(self) -> PushReport | None:
        """Push the version the trainer holds (:attr:`weight_version`) again, every rank: engines restarted
        while none served (:mod:`miles.rollout.failover`) take it, verified, and serve again."""
        return await self.publish(int(self.weight_version))

    async def flush(self) -> None:
        """Wait until what was published is served and verified (rank 0); a verification failure raises."""

    async def close(self) -> None:
        """Cancel what is pending (the run is ending)."""

    def buckets(self) -> Iterator[list[tuple[str, Any]]]:
        """The trainer's weights in buckets, converted to what the engines serve (a collective: every rank)."""
        loop = self.loop
        raw = loop.trainer.iter_weights(loop.settings.transport.bucket_bytes)
        converted = ([*loop.precision.rollout_weights(bucket)] for bucket in raw)
        if self.sampler is not None and self.is_driver:
            return self.sampler.observe(converted)
        return converted

    async def randomize_engines(self, step: int) -> None:
        """Test mode ``transport.randomize_engines_first``: random engine weights before a push (rank 0), so a
        tensor the push misses shows in its verification."""
        loop = self.loop
        if self.is_driver and loop.settings.transport.randomize_engines_first:
            assert loop.client is not None
            await loop.client.randomize_weights(seed=step)

    async def verify(self, report: PushReport, *, step: int) -> None:
        """Rank 0: check the engines serve what was pushed (``transport.verify``): the transport's own check,
        else the sampled rows (:attr:`sampler`), else every tensor's checksum; tell the plugins."""
        if not self.is_driver:
            return
        from miles.transport.verify import verify_engines, verify_sampled

        loop = self.loop
        transport, client = loop.transport, loop.client
        assert transport is not None
        if loop.settings.transport.verify:
            assert client is not None
            own = await transport.verify(client, report)
            if own is not None:
                report.verification = own
            elif self.verification == "logprobs":
                from miles.transport.verify import default_logprob_tolerance, verify_logprobs

                tolerance = loop.settings.transport.verify_logprob_tolerance
                report.verification = await verify_logprobs(
                    client,
                    version=report.version,
                    probe=self.probe,
                    expected=self._probe_expected[report.version],
                    tolerance=tolerance or default_logprob_tolerance(transport.engine_dtype),
                )
            elif self.sampler is not None:
                report.verification = await verify_sampled(client, version=report.version, samples=self.sampler.samples)
            else:
                report.verification = await verify_engines(
                    client, version=report.version, checksums_by_dtype={transport.engine_dtype: report.checksums}
                )
        loop.pm.on_weights_pushed(step=step, version=report.version, report=report)

    def metrics(self, report: PushReport | None) -> dict[str, float]:
        """The step's ``weight_sync/*`` metrics (rank 0)."""
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

    async def _check_engines(self) -> list[str]:
        """Rank 0, before a push: engines that died are left out of it, restarted ones take it and rejoin
        (:mod:`miles.rollout.failover`). Returns the engines that take the push (none on other ranks)."""
        if self.is_driver and self.loop.client is not None:
            await self.loop.client.check_engines()
            return list(self.loop.client.urls)
        return []

    async def _engines_lost(
        self, error: BaseException | None, before: list[str], version: str, retries: int, doing: str
    ) -> bool:
        """Rank 0, after a push or commit of ``version`` to ``before`` failed with ``error``: whether it failed
        (:class:`~miles.errors.EngineError`) because engines died during it (they no longer answer
        ``/health``) while others are left, or none is left but a restarted one answers again in time
        (:meth:`~miles.rollout.client.EngineClient.wait_for_a_restart`); then the whole version goes again to
        those. Each retry needs a new engine lost (a restart only as often as ``rollout.engine_restarts``),
        so the retries are bounded."""
        client = self.loop.client
        if not isinstance(error, EngineError) or client is None:
            return False
        await client.check_engines()
        lost = [url for url in before if url not in client.urls]
        if lost and not client.urls:
            log.error("%s; %s went down during the push and no engine is left", error, ", ".join(lost))
            await client.wait_for_a_restart()
        if not lost or not client.urls:
            return False
        log.error(
            "%s; %s went down during the push: %s weight version %s again to %s (retry %d)",
            error,
            ", ".join(lost),
            doing,
            version,
            ", ".join(client.urls),
            retries + 1,
        )
        return True

    def _weights_reached(self, version: str) -> None:
        """Rank 0, after a verified push: the engines that took it while rejoining serve again."""
        if self.is_driver and self.loop.client is not None:
            self.loop.client.weights_reached(version)

    async def _paused(self, work: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``work`` with the engines paused when the source is generating meanwhile (rank 0)."""
        loop, source = self.loop, self.loop.source
        paused = self.is_driver and loop.client is not None and source is not None and source.producing
        start = time.perf_counter()
        if paused:
            assert loop.client is not None
            await loop.client.pause_generation(loop.settings.rollout.pause_mode)
        try:
            return await work()
        finally:
            if paused:
                assert loop.client is not None and source is not None
                await loop.client.continue_generation()
                if hasattr(source, "pause_seconds"):
                    source.pause_seconds += time.perf_counter() - start


class InlinePublisher(WeightPublisher):
    """Push and verify within the step."""

    async def publish(self, step: int) -> PushReport | None:
        loop = self.loop
        if loop.transport is None:
            return None
        transport = loop.transport
        version = str(step)
        if self.colocation is not None:  # (the probe's logprobs read the trainer's weights too)
            await self.colocation.before_push()
        self.probe_expected(version)

        async def push() -> PushReport:
            retries = 0
            while True:
                before = await self._check_engines()
                await self.randomize_engines(step)
                report, error = await self._push_once(transport, version)
                if not await self._push_again(error, before, version, retries):
                    break
                retries += 1
            if error is not None:
                raise error
            assert report is not None
            if retries:
                report.metrics["weight_sync/retries"] = float(retries)
            self.weight_version = version
            if self.colocation is not None:  # (then the engines generate again: verification may generate)
                await self.colocation.after_push()
            return report

        report: PushReport = await self._paused(push)
        # verified once the engines generate again: a paused engine holds the logprob probe (a generation)
        await self.verify(report, step=step)
        self._weights_reached(version)
        if self.is_driver and loop.source is not None:
            loop.source.weights_changed(int(self.weight_version))
        return report

    async def _push_once(self, transport: WeightTransport, version: str) -> tuple[PushReport | None, Exception | None]:
        """One push of ``version`` on every rank; a failure is returned, once the buckets are drained (each
        bucket is a collective of every rank: the others have gathered them all)."""
        loop = self.loop
        buckets = iter(self.buckets())
        try:
            return await transport.push(buckets, version=version, dist=loop.dist), None
        except Exception as exc:
            if loop.dist.world_size > 1 and transport.reads_buckets:
                for _ in buckets:
                    pass
            return None, exc

    async def _push_again(self, error: Exception | None, before: list[str], version: str, retries: int) -> bool:
        """Every rank: whether to push ``version`` again, as rank 0 decides (:meth:`_engines_lost`)."""
        from miles.training.comm import broadcast_json

        again = self.is_driver and await self._engines_lost(error, before, version, retries, "pushing")
        return bool(broadcast_json(again))


class OverlappedPublisher(WeightPublisher):
    """Stage in the step, commit while the next step trains (see the module docstring)."""

    def __init__(self, loop: PublishContext, *, sample_pushes: bool = False) -> None:
        super().__init__(loop, sample_pushes=sample_pushes)
        self._commit: asyncio.Task[PushReport] | None = None
        self._committed: dict[str, float] = {}
        """Metrics of the last awaited commit, logged with the next step."""

    async def publish(self, step: int) -> PushReport | None:
        await self.flush()
        loop = self.loop
        transport = loop.transport
        assert isinstance(transport, StagedTransport)
        version = str(step)
        buckets = self.buckets()

        async def stage() -> PushReport:
            self.probe_expected(version)
            return await transport.stage(buckets, version=version, dist=loop.dist)

        report: PushReport = await loop.on_compute_thread(stage)
        self.weight_version = version
        if self.is_driver:
            if loop.source is not None:  # the trainer holds the new version; the engines serve the old one
                loop.source.weights_changed(int(version), engines_follow=False)
            self._commit = asyncio.create_task(self._commit_version(report, step), name=f"commit-v{version}")
            if step >= loop.settings.train.num_rollouts:
                await self.flush()  # nothing left to overlap with: log the last version's verification
        return report

    async def _commit_version(self, report: PushReport, step: int) -> PushReport:
        """Rank 0, concurrently with the next training step: prepare, pause, load, continue, verify."""
        loop = self.loop
        transport = loop.transport
        assert isinstance(transport, StagedTransport)
        start = time.perf_counter()
        staged_seconds = report.seconds
        await transport.prepare(report)  # the engines keep generating while the weights are written
        pause_start = time.perf_counter()

        retries = 0

        async def load() -> None:
            nonlocal retries
            while True:
                before = await self._check_engines()
                if not retries:  # (once: a retry may deliver only to the engines that lack the version)
                    await self.randomize_engines(step)
                try:
                    await transport.commit(report)
                    break
                except Exception as error:  # the version stays staged: it may be committed again
                    if not await self._engines_lost(error, before, report.version, retries, "committing"):
                        raise
                retries += 1
            if loop.source is not None:
                loop.source.engines_caught_up(int(report.version))

        await self._paused(load)
        loaded = time.perf_counter()
        await self.verify(report, step=step)
        self._weights_reached(report.version)
        done = time.perf_counter()
        report.seconds = staged_seconds  # what the trainer waited for; the commit is reported apart
        self._committed = {
            **report.verification,
            "weight_sync/committed_version": float(report.version),
            "weight_sync/commit_seconds": done - start,
            "weight_sync/prepare_seconds": pause_start - start,
            "weight_sync/load_seconds": loaded - pause_start,
            "weight_sync/verify_seconds": done - loaded,
        }
        if retries:
            self._committed["weight_sync/retries"] = float(retries)
        return report

    async def flush(self) -> None:
        task, self._commit = self._commit, None
        if task is not None:
            await task

    async def close(self) -> None:
        task, self._commit = self._commit, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def metrics(self, report: PushReport | None) -> dict[str, float]:
        out = {k: v for k, v in super().metrics(report).items() if not k.startswith("weight_sync/verified")}
        out.update(self._committed)  # the previous version's commit, awaited by this step's push
        self._committed = {}
        return out


def make_publisher(loop: PublishContext, run: Run) -> WeightPublisher:
    """The publisher of ``run`` (the same kind on every rank): pushes staged and committed while the next step
    trains (:class:`OverlappedPublisher`) in the async modes with a staging transport,
    ``rollout.overlap_weight_commit`` and no colocation; otherwise pushed in line (:class:`InlinePublisher`).
    Pushes are sampled for verification where the engines have no checksum route."""
    rollout = loop.settings.rollout
    overlapped = (
        rollout.mode != "sync"
        and isinstance(loop.transport, StagedTransport)
        and rollout.overlap_weight_commit
        and run.algorithm.needs.rollout
        and not loop.settings.cluster.colocate
    )
    publisher = OverlappedPublisher if overlapped else InlinePublisher
    return publisher(loop, sample_pushes=loop.transport is not None and not run.engine_capabilities.weights_checksum)
