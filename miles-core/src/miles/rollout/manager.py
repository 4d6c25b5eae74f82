"""The rollout manager: prompts in, scored and filtered sample groups out.

Each prompt is sampled ``n_samples_per_prompt`` times through the engine client with the group's
routing key (so the group's prefix is cached once on one engine), every sample gets a seed derived from
the run seed, its group and its index (so a rollout is reproducible and a resumed run sees the same
samples), rewards are computed, a teacher scores the samples when ``rollout.teacher.url`` is set (on-policy
distillation, :mod:`miles.rollout.teacher`), and the algorithm decides which groups to keep (dynamic
sampling); the manager keeps generating until the batch is full.

:meth:`RolloutManager.produce_group` is the one generate-and-score path: the synchronous
:meth:`~RolloutManager.rollout` and the asynchronous :class:`~miles.rollout.producer.RolloutProducer`
both call it, and both admit groups with the same :class:`DropBudget` (a filter may drop at most
``max_rounds x rollout_batch_size`` groups in a row; the next one is kept anyway, so an uninformative
data set cannot stall a run).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from miles.rewards.scoring import Scorer
from miles.rollout.facts import RoutedExpertsClient, logit_masks, shape_routed_experts
from miles.rollout.failover import NoEngineLeftError
from miles.rollout.protocol import GenerateOutput, SamplingParams
from miles.rollout.teacher import TeacherScorer, teacher_for
from miles.types import Sample, SampleGroup, SampleStatus, WeightSpan

if TYPE_CHECKING:
    from miles.algorithms.base import Algorithm
    from miles.data.base import DataSource, Prompt
    from miles.models import RoutedLayout
    from miles.rollout.client import EngineClient
    from miles.rollout.function import RolloutFunction
    from miles.settings.model import RolloutSettings

__all__ = [
    "DropBudget",
    "RolloutManager",
    "RolloutResult",
    "reward_part_metrics",
    "rollout_metrics",
    "sample_from_output",
    "single_turn",
]

log = logging.getLogger(__name__)


@dataclass
class RolloutResult:
    """The groups of one rollout and its metrics."""

    groups: list[SampleGroup]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


class DropBudget:
    """Dynamic sampling's admission rule: an informative group is kept; an uninformative one is dropped,
    unless ``limit`` groups were dropped in a row — then it is kept anyway, with a warning.

    The synchronous rollout and the asynchronous producer admit every group through one of these.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_row = 0
        self.dropped = 0
        """Groups dropped since the last :meth:`take_dropped`."""

    def admit(self, group: SampleGroup, informative: bool) -> bool:
        if informative:
            self.in_row = 0
            return True
        if self.in_row < self.limit:
            self.in_row += 1
            self.dropped += 1
            return False
        log.warning("dynamic sampling dropped %d groups in a row; keeping group %d anyway", self.in_row, group.group_id)
        self.in_row = 0
        return True

    def take_dropped(self) -> int:
        dropped, self.dropped = self.dropped, 0
        return dropped


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integers, stable across processes and Python versions."""
    digest = hashlib.blake2b(",".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def _status_of(output: GenerateOutput) -> tuple[SampleStatus, str]:
    reason = output.finish_reason
    if reason.type == "stop":
        return SampleStatus.COMPLETED, ""
    if reason.type == "length":
        return SampleStatus.TRUNCATED, f"length {reason.length}" if reason.length is not None else "length"
    return SampleStatus.ABORTED, reason.message or "aborted by the engine"


def _version(value: str | None) -> int:
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


def sample_from_output(sample: Sample, output: GenerateOutput) -> Sample:
    """Fill a sample's response from one engine output (single turn: every token trained on)."""
    n = len(output.output_ids)
    status, reason = _status_of(output)
    if output.weight_version_spans:  # the weights changed under the request (a partial rollout)
        spans = [WeightSpan(start, end, _version(version)) for start, end, version in output.weight_version_spans]
    else:
        spans = [WeightSpan(0, n, _version(output.weight_version))] if n else []
    routed_shape = None
    if output.routed_experts is not None:  # (shaped by the client: RoutedExpertsClient)
        shape = shape_routed_experts(output, None).meta_info["routed_experts_shape"]
        routed_shape = (int(shape[0]), int(shape[1]), int(shape[2]))
    behaviour = output.sampling_logprobs if output.sampling_mask is not None else None
    return replace(
        sample,
        response_ids=list(output.output_ids),
        # with the kept sets: the behaviour logprobs (of the renormalised set each token was drawn from)
        rollout_logprobs=list(behaviour if behaviour is not None else output.output_logprobs),
        sampling_mask=output.sampling_mask if behaviour is not None else None,
        loss_mask=[1] * n,
        response=output.text,
        status=status,
        status_reason=reason,
        weight_versions=spans,
        routed_experts=output.routed_experts,
        routed_experts_shape=routed_shape,
        metadata={
            **sample.metadata,
            "cached_tokens": output.cached_tokens,
            "prompt_tokens": output.prompt_tokens,
            **({"engine_url": output.meta_info["engine_url"]} if "engine_url" in output.meta_info else {}),
        },
    )


async def single_turn(client: EngineClient, sample: Sample, sampling_params: SamplingParams) -> Sample:
    """The default rollout function: one ``/generate`` call for one sample."""
    routing_key = str(sample.metadata.get("routing_key", f"group-{sample.group_id}"))
    prompt_ids, images = sample.prompt_ids, sample.metadata.get("images") or None  # (miles.data.vision)
    if images:  # as data (the engine may run on another host than the data's files), one placeholder each
        from miles.data.images import image_bytes, to_data_url
        from miles.data.vision import IMAGE_TOKEN, collapse_placeholders

        images = [ref if str(ref).startswith("data:") else to_data_url(image_bytes(ref)) for ref in images]
        if IMAGE_TOKEN in sample.metadata:  # SGLang's form: it expands each placeholder token it is given
            prompt_ids = collapse_placeholders(prompt_ids, int(sample.metadata[IMAGE_TOKEN]))
    extra: dict[str, Any] = {"image_data": images} if images else {}  # (a plugin's engine client may not take it)
    outputs = await client.generate(prompt_ids, replace(sampling_params, n=1), routing_key=routing_key, **extra)
    return sample_from_output(sample, outputs[0])


class RolloutManager:
    """Turns prompts into scored sample groups.

    :param client: the engines.
    :param settings: the ``rollout`` settings section.
    :param scorer: rewards (see :func:`miles.rewards.scoring.score_samples`).
    :param algorithm: asked which groups to keep (dynamic sampling).
    :param rollout_function: replaces :func:`single_turn` (agents, tools, multi-turn).
    :param seed: run seed; sample seeds are derived from it, the group id and the sample index.
    :param max_rounds: with ``rollout_batch_size``, how many groups dynamic sampling may drop in a row
        (``max_rounds x rollout_batch_size``) before it keeps one anyway.
    :param return_routed_experts: ask every ``/generate`` for the experts the engine routed each token to
        (MoE models: routing replay and the routing-agreement metric).
    :param routed_layout: the policy's routers, to read routed experts an engine sends without a shape
        (SGLang; :func:`miles.rollout.facts.shape_routed_experts`).
    :param eos_token_ids: the engine's EOS ids; single-turn samples record the logit masks the engine
        applied before ``min_new_tokens`` (:func:`miles.rollout.facts.logit_masks`).
    """

    def __init__(
        self,
        client: EngineClient,
        settings: RolloutSettings,
        *,
        scorer: Scorer,
        algorithm: Algorithm | None = None,
        rollout_function: RolloutFunction | None = None,
        seed: int = 0,
        max_rounds: int = 8,
        return_routed_experts: bool = False,
        routed_layout: RoutedLayout | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.client = client
        self.settings = settings
        self.teacher: TeacherScorer | None = teacher_for(
            settings.teacher, algorithm.needs if algorithm is not None else None
        )
        self.scorer = scorer if self.teacher is None else self._with_teacher(scorer, self.teacher)
        self.algorithm = algorithm
        self.rollout_function: RolloutFunction = rollout_function or single_turn
        self.seed = seed
        self.max_rounds = max_rounds
        self.return_routed_experts = return_routed_experts
        self.eos_token_ids = list(eos_token_ids)
        self._generate_client: EngineClient = (
            RoutedExpertsClient(client, routed_layout) if return_routed_experts else client
        )
        if settings.replay_sampling_mask:
            client.return_sampling_mask = True
        self.next_group_id = 0
        self._function_started = False
        self.budget = DropBudget(max_rounds * settings.rollout_batch_size)
        """The admission rule every produced group goes through."""

    @staticmethod
    def _with_teacher(scorer: Scorer, teacher: TeacherScorer) -> Scorer:
        """Rewards, then the teacher's logprobs (every path that scores samples gets both)."""

        async def score(samples: Sequence[Sample]) -> None:
            await scorer(samples)
            await teacher.score(samples)

        return score

    # -- state (saved in checkpoints) ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"next_group_id": self.next_group_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_group_id = int(state["next_group_id"])

    # -- generation --------------------------------------------------------------------------------
    def sampling_params(self, seed: int | None = None) -> SamplingParams:
        s = self.settings
        return SamplingParams(
            max_new_tokens=s.max_new_tokens,
            min_new_tokens=s.min_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop=list(s.stop),
            stop_token_ids=list(s.stop_token_ids),
            sampling_seed=seed,
        )

    def new_group(self, prompt: Prompt) -> list[Sample]:
        """The pending samples of one prompt's group (assigns the next group id)."""
        if prompt.prompt_ids is None:
            raise ValueError(f"prompt from {prompt.source or '?'} was not tokenised (prompt_ids is None)")
        group_id = self.next_group_id
        self.next_group_id += 1
        return [
            Sample(
                prompt_ids=list(prompt.prompt_ids),
                group_id=group_id,
                index=i,
                prompt=prompt.text,
                prompt_messages=prompt.messages,
                label=prompt.label,
                metadata={**prompt.metadata, "source": prompt.source} if prompt.source else dict(prompt.metadata),
            )
            for i in range(self.settings.n_samples_per_prompt)
        ]

    async def start(self) -> None:
        """Start what the rollout function serves from (its optional ``start(client, settings)``, e.g. a
        session server); idempotent, and called before the first sample."""
        if self._function_started:
            return
        start = getattr(self.rollout_function, "start", None)
        if start is not None:
            await start(self.client, self.settings)
        self._function_started = True

    async def close(self) -> None:
        """Stop what the rollout function started (its optional ``aclose()``), whichever manager started it:
        managers of one run share the function (``miles train``'s evaluation builds its own), and the run's
        manager is closed once, at the end."""
        aclose = getattr(self.rollout_function, "aclose", None)
        if aclose is not None:
            await aclose()
        self._function_started = False

    async def generate_sample(self, sample: Sample, *, retries: int = 2) -> Sample:
        """Run the rollout function for one sample; an aborted sample is retried from scratch."""
        await self.start()
        seed = derive_seed(self.seed, sample.group_id, sample.index)
        params = self.sampling_params(seed)
        result = sample
        for attempt in range(retries + 1):
            try:
                result = await self.rollout_function(self._generate_client, sample, params)
            except NoEngineLeftError:
                raise  # every engine is down: the run stops (fail-stop), it does not fail every sample
            except Exception as exc:  # an engine or tool failure marks the sample, never stops the run
                log.warning("sample %d/%d failed: %s", sample.group_id, sample.index, exc)
                return replace(sample, status=SampleStatus.FAILED, status_reason=f"rollout failed: {exc}")
            if result.status != SampleStatus.ABORTED:
                if self.rollout_function is single_turn and not result.logit_masks:
                    masks = logit_masks(params, self.eos_token_ids, length=result.response_length)
                    result = replace(result, logit_masks=masks)
                return result
            log.info(
                "sample %d/%d aborted (%s), attempt %d",
                sample.group_id,
                sample.index,
                result.status_reason,
                attempt + 1,
            )
        return result

    def pending_group(self, prompt: Prompt) -> SampleGroup:
        """:meth:`new_group` as a :class:`SampleGroup`."""
        samples = self.new_group(prompt)
        return SampleGroup(samples[0].group_id, samples)

    async def produce_group(self, pending: SampleGroup) -> tuple[SampleGroup, bool]:
        """The one generate-and-score path: every sample of ``pending`` generated, the group scored
        (rewards, then the teacher), and whether the algorithm finds it informative (dynamic sampling).
        Admission (:attr:`budget`) is the caller's: in group order (sync) or as groups finish (async)."""
        samples = await asyncio.gather(*(self.generate_sample(s) for s in pending.samples))
        group = SampleGroup(pending.group_id, list(samples))
        await self.scorer(group.samples)
        informative = self.algorithm.keep_groups([group])[0] if self.algorithm is not None else True
        return group, informative

    async def generate_group(self, prompt: Prompt) -> SampleGroup:
        """Generate one prompt's group (no scoring)."""
        pending = self.pending_group(prompt)
        done = await asyncio.gather(*(self.generate_sample(s) for s in pending.samples))
        return SampleGroup(pending.group_id, list(done))

    async def rollout(self, data: DataSource) -> RolloutResult:
        """One rollout: ``rollout_batch_size`` kept groups, scored.

        Each round produces the groups still missing, concurrently; they are admitted in group order.
        """
        start = time.perf_counter()
        want = self.settings.rollout_batch_size
        kept: list[SampleGroup] = []
        generated = rounds = 0
        while len(kept) < want:
            rounds += 1
            pending = [self.pending_group(p) for p in data.next_batch(want - len(kept))]
            produced = await asyncio.gather(*(self.produce_group(g) for g in pending))
            generated += len(produced)
            for group, informative in produced:
                if self.budget.admit(group, informative):
                    kept.append(group)
        self.budget.take_dropped()
        metrics = self.batch_metrics(kept, seconds=time.perf_counter() - start)
        metrics["rollout/groups_generated"] = float(generated)
        metrics["rollout/groups_dropped"] = float(generated - len(kept))
        metrics["rollout/rounds"] = float(rounds)
        return RolloutResult(kept, metrics)

    def batch_metrics(self, groups: Sequence[SampleGroup], *, seconds: float) -> dict[str, float]:
        """:func:`rollout_metrics`, and the rollout function's own (its optional ``metrics(samples)``: an agent
        rollout's turns, append-only violations and branches)."""
        metrics = rollout_metrics(groups, seconds=seconds)
        own = getattr(self.rollout_function, "metrics", None)
        if own is not None:
            metrics.update(own([s for g in groups for s in g.samples]))
        return metrics


def rollout_metrics(groups: Sequence[SampleGroup], *, seconds: float) -> dict[str, float]:
    """Rewards, lengths, statuses, prefix-cache hit rate and weight versions of a batch of groups, and
    tokens per second over ``seconds``."""
    samples = [s for g in groups for s in g.samples]
    n = max(len(samples), 1)
    rewards = [0.0 if s.reward is None else float(s.reward) for s in samples]
    mean = sum(rewards) / n
    lengths = [s.response_length for s in samples]
    prompt_tokens = sum(len(s.prompt_ids) for s in samples)
    cached = sum(int(s.metadata.get("cached_tokens", 0)) for s in samples)
    metrics = {
        "rollout/reward_mean": mean,
        "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "rollout/response_length_mean": sum(lengths) / n,
        "rollout/response_length_max": float(max(lengths, default=0)),
        "rollout/truncated_fraction": sum(s.status == SampleStatus.TRUNCATED for s in samples) / n,
        "rollout/failed_fraction": sum(s.status == SampleStatus.FAILED for s in samples) / n,
        "rollout/prefix_cache_hit_rate": cached / max(prompt_tokens, 1),
        "rollout/seconds": seconds,
        "rollout/tokens_per_second": sum(lengths) / max(seconds, 1e-9),
    }
    parts: dict[str, list[float]] = {}
    for s in samples:
        for name, value in s.reward_parts.items():
            parts.setdefault(name, []).append(float(value))
    for name, values in parts.items():
        metrics[f"rollout/reward_{name}_mean"] = sum(values) / len(values)
    metrics.update(reward_part_metrics(parts))
    routed = [(len(s.tokens), shape) for s in samples if (shape := s.routed_experts_shape) is not None]
    if routed:  # what the trainer holds per sample (int16, TrainBatch.token_tensors["routed_experts"])
        per_sample = [2 * tokens * shape[1] * shape[2] for tokens, shape in routed]
        metrics["rollout/routed_experts_bytes_per_sample"] = sum(per_sample) / len(per_sample)
    versions = [v for s in samples if (v := s.oldest_weight_version) is not None]
    if versions:
        metrics["rollout/weight_version_min"] = float(min(versions))
        metrics["rollout/weight_version_max"] = float(max(versions))
    return metrics


def reward_part_metrics(parts: dict[str, list[float]]) -> dict[str, float]:
    """Per reward function (a name of ``Sample.reward_parts`` without ``/``) over the scored samples of a step:
    ``reward/<name>/mean``, ``reward/<name>/std`` and ``reward/<name>/degenerate``, 1 when every sample (two or
    more) got the same value — a reward model answering a constant wastes the run — else 0; named parts
    (``<name>/<part>``) get their mean. A degenerate function is said in the log."""
    metrics: dict[str, float] = {}
    for name, values in parts.items():
        mean = sum(values) / len(values)
        metrics[f"reward/{name}/mean"] = mean
        if "/" in name:
            continue
        metrics[f"reward/{name}/std"] = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
        degenerate = len(values) > 1 and max(values) == min(values)
        metrics[f"reward/{name}/degenerate"] = 1.0 if degenerate else 0.0
        if degenerate:
            log.warning("reward %r gave every one of the step's %d scored samples %.6g", name, len(values), mean)
    return metrics
