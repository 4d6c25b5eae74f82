"""Per-kind conformance checks: one component class against its kind's interface, on real inputs.

Each check instantiates the component with its settings (default: its settings model's defaults), runs
it on real data (samples, groups, tensors, files) and raises :class:`AssertionError` naming the
component and what is wrong. :func:`miles.testing.check_plugin` checks the plugin that registers it.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel

from miles.components import ComponentKind
from miles.testing.conformance import check_component, component_settings, describe, failure, run_coroutine
from miles.testing.samples import example_groups, example_samples
from miles.types import Sample, SampleGroup

__all__ = [
    "check_algorithm",
    "check_data_source",
    "check_logger",
    "check_precision",
    "check_reward",
    "check_rollout_function",
    "check_transport",
]


def check_reward(
    cls: Any,
    *,
    samples: Sequence[Sample] | None = None,
    settings: BaseModel | Mapping[str, Any] | None = None,
) -> list[float]:
    """Check a :class:`~miles.rewards.base.Reward` class: it instantiates with ``settings`` (default: its
    settings model's defaults), ``score`` and ``close`` are coroutines, and every sample gets a finite float
    or a :class:`~miles.rewards.base.RewardOutput` with finite value and parts. A
    :class:`~miles.rewards.base.GroupReward` scores the samples of each group (``group_id``) with one
    ``score_group`` call, which must be a coroutine and answer one result per sample.

    :param samples: samples to score (default :func:`example_samples`).
    :returns: the rewards' values, one per sample.
    """
    from miles.rewards.base import GroupReward, Reward

    check_component(ComponentKind.REWARD, cls)
    where = describe(ComponentKind.REWARD, cls)
    grouped = isinstance(cls, type) and issubclass(cls, GroupReward)
    for method in ("score", "close", *(("score_group",) if grouped else ())):
        if not inspect.iscoroutinefunction(getattr(cls, method)):
            raise failure(where, f"{method} must be a coroutine function (async def {method}(...)), it is synchronous")
    options = component_settings(ComponentKind.REWARD, cls, settings)
    reward: Reward = cls(options)
    todo = list(samples) if samples is not None else example_samples()

    async def score_groups(scorer: GroupReward) -> list[Any]:
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(todo):
            groups.setdefault(s.group_id, []).append(i)
        out: list[Any] = [None] * len(todo)
        for group_id, members in groups.items():
            results = await scorer.score_group([todo[i] for i in members])
            if len(results) != len(members):
                raise failure(
                    where, f"score_group(group {group_id}) returned {len(results)} results for {len(members)} samples"
                )
            for i, result in zip(members, results, strict=True):
                out[i] = result
        return out

    async def score_all() -> list[Any]:
        try:
            if isinstance(reward, GroupReward):
                return await score_groups(reward)
            return [await reward.score(s) for s in todo]
        finally:
            await reward.close()

    return [
        _reward_value(f"{where}: score(sample {i}, response={todo[i].response[:40]!r})", result)
        for i, result in enumerate(run_coroutine(score_all))
    ]


def _reward_value(at: str, result: Any) -> float:
    """The finite value of one reward result, or an :class:`AssertionError` at ``at`` saying what is wrong."""
    from miles.rewards.base import RewardOutput

    if isinstance(result, RewardOutput):
        value = result.value
        for part, part_value in result.parts.items():
            if not isinstance(part, str) or isinstance(part_value, bool) or not isinstance(part_value, (int, float)):
                raise AssertionError(f"{at}: RewardOutput.parts must map str to float, got {part!r}: {part_value!r}")
            if not math.isfinite(part_value):
                raise AssertionError(f"{at}: RewardOutput.parts[{part!r}] is not finite: {part_value!r}")
    else:
        value = result
    if isinstance(value, Exception):
        raise AssertionError(f"{at}: the sample was not scored: {type(value).__name__}: {value}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AssertionError(f"{at}: must return a float or a RewardOutput, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise AssertionError(f"{at}: returned a non-finite reward {value!r}")
    return float(value)


def check_algorithm(
    cls: Any,
    *,
    groups: Sequence[SampleGroup] | None = None,
    settings: BaseModel | Mapping[str, Any] | None = None,
) -> None:
    """Check an :class:`~miles.algorithms.base.Algorithm` class on real tensors: ``needs`` is an
    ``AlgorithmNeeds``; ``aggregation`` is known; ``keep_groups`` returns one bool per group;
    ``compute_advantages`` returns one finite 1-D tensor per sample with the sample's response length;
    ``loss`` returns a finite ``[T]`` per-token loss (and ``[T]`` metrics) through which gradients flow to
    the logprobs.

    :param groups: scored groups (default :func:`example_groups`).
    """
    import torch

    from miles.algorithms.base import AdvantageInputs, Advantages, Aggregation, AlgorithmNeeds, LossInputs, LossOutput

    check_component(ComponentKind.ALGORITHM, cls)
    where = describe(ComponentKind.ALGORITHM, cls)
    algo = cls(component_settings(ComponentKind.ALGORITHM, cls, settings))
    groups = list(groups) if groups is not None else example_groups()
    needs = algo.needs
    if not isinstance(needs, AlgorithmNeeds):
        raise failure(where, f"needs must be an AlgorithmNeeds, got {type(needs).__name__}")
    if algo.aggregation not in get_args(Aggregation):
        raise failure(where, f"aggregation {algo.aggregation!r} is not one of {', '.join(get_args(Aggregation))}")
    norm = algo.seq_len_norm
    if not (isinstance(norm, (int, float)) and math.isfinite(norm) and norm > 0):
        raise failure(where, f"seq_len_norm must be a positive finite number, got {norm!r}")
    keep = algo.keep_groups(groups)
    if not (isinstance(keep, list) and len(keep) == len(groups) and all(isinstance(k, bool) for k in keep)):
        raise failure(where, f"keep_groups must return one bool per group ({len(groups)}), got {keep!r}")

    lengths = [[s.response_length for s in g] for g in groups]
    values = [[torch.linspace(-0.5, 0.5, n) for n in row] for row in lengths] if needs.values else None
    ref = None
    if needs.ref_logprobs_for_advantages:
        ref = [[torch.tensor(s.rollout_logprobs) - 0.1 for s in g.samples] for g in groups]
    result = algo.compute_advantages(AdvantageInputs(groups, values, ref))
    if not isinstance(result, Advantages):
        raise failure(where, f"compute_advantages must return an Advantages, got {type(result).__name__}")
    advantages = result.advantages
    if not (isinstance(advantages, list) and len(advantages) == len(groups)):
        raise failure(
            where,
            f"compute_advantages must return one list per group ({len(groups)}), got {type(advantages).__name__} of {len(advantages) if isinstance(advantages, list) else '?'}",
        )
    for g, (row, expected) in enumerate(zip(advantages, lengths, strict=True)):
        if not (isinstance(row, list) and len(row) == len(expected)):
            raise failure(where, f"compute_advantages: group {g} must have one tensor per sample ({len(expected)})")
        for i, (adv, n) in enumerate(zip(row, expected, strict=True)):
            if not isinstance(adv, torch.Tensor) or adv.shape != (n,):
                shape = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
                raise failure(
                    where,
                    f"compute_advantages: group {g} sample {i} must be a tensor of shape ({n},) (its response length), got {shape}",
                )
            if not torch.isfinite(adv).all():
                raise failure(where, f"compute_advantages: group {g} sample {i} has non-finite values")

    returns = result.returns
    if returns is not None:
        flat = [r for row in returns for r in row]
        if [tuple(r.shape) for r in flat] != [(n,) for row in lengths for n in row]:
            raise failure(where, "compute_advantages: returns must hold one tensor per sample with its response length")
    samples = [s for g in groups for s in g.samples]

    def cat(rows: Iterable[Sequence[float]]) -> torch.Tensor:
        return torch.tensor([v for row in rows for v in row], dtype=torch.float32)

    rollout = cat(s.rollout_logprobs for s in samples)
    shift = torch.linspace(-0.2, 0.2, rollout.numel())
    logprobs = (rollout + shift).requires_grad_(True)
    mask = cat(s.loss_mask for s in samples)
    count = rollout.numel()
    topk_teacher, topk_student = _topk_inputs(samples, getattr(needs, "teacher_topk", 0), count)
    inputs = LossInputs(
        logprobs=logprobs,
        loss_mask=mask,
        response_lengths=[s.response_length for s in samples],
        advantages=torch.cat([a for row in advantages for a in row]).float(),
        old_logprobs=rollout.clone() if needs.old_logprobs else None,
        rollout_logprobs=rollout.clone(),
        ref_logprobs=(rollout - 0.1) if needs.ref_logprobs else None,
        teacher_logprobs=cat(s.teacher_logprobs or [0.0] * s.response_length for s in samples)
        if needs.teacher_logprobs
        else None,
        teacher_topk_logprobs=topk_teacher,
        student_topk_logprobs=topk_student,
        entropy=torch.full((count,), 1.5),
        values=torch.cat([v for row in values for v in row]).requires_grad_(True) if values is not None else None,
        old_values=torch.cat([v for row in values for v in row]) if values is not None else None,
        returns=(
            torch.cat([r for row in returns for r in row]).float()
            if returns is not None
            else torch.linspace(-1.0, 1.0, count)
        )
        if needs.values
        else None,
    )
    out = algo.loss(inputs)
    if not isinstance(out, LossOutput):
        raise failure(where, f"loss must return a LossOutput, got {type(out).__name__}")
    loss = out.per_token_loss
    if not isinstance(loss, torch.Tensor) or loss.shape != (count,):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise failure(where, f"loss: per_token_loss must have shape [T] = ({count},), got {shape}")
    if not torch.isfinite(loss).all():
        raise failure(where, "loss: per_token_loss has non-finite values")
    for key, metric in out.metrics.items():
        if not isinstance(metric, torch.Tensor) or metric.shape != (count,):
            shape = tuple(metric.shape) if isinstance(metric, torch.Tensor) else type(metric).__name__
            raise failure(where, f"loss: metric {key!r} must be a per-token tensor of shape ({count},), got {shape}")
    if needs.rollout and loss.requires_grad:
        (loss * mask).sum().backward()
        # top-k distillation's gradient reaches the policy through student_topk_logprobs
        grads = [t.grad for t in (logprobs, topk_student) if t is not None and t.grad is not None]
        if not grads or not all(bool(torch.isfinite(g).all()) for g in grads):
            raise failure(where, "loss: gradients do not flow (finitely) to the logprobs")
    elif not loss.requires_grad:
        raise failure(where, "loss: per_token_loss does not depend on the logprobs (no gradient)")


_TRANSPORT_INIT = {"model_path": None, "engine_dtype": "float32"}
"""Constructor keywords of :class:`~miles.transport.base.WeightTransport` besides ``run_dir``."""


def _topk_inputs(samples: Sequence[Sample], k: int, count: int) -> tuple[Any, Any]:
    """``[T, k]`` teacher and student top-k logprobs for an algorithm whose ``needs.teacher_topk`` is ``k``:
    the samples' teacher rows when they all have ``k`` of them, else distinct synthetic distributions."""
    import torch

    if k <= 0:
        return None, None
    grid = torch.linspace(-1.0, 1.0, count * k).reshape(count, k)
    student = (torch.log_softmax(grid, dim=-1) - 0.2).requires_grad_(True)
    rows = [s.teacher_topk_logprobs for s in samples]
    if all(r is not None and len(r) == s.response_length for r, s in zip(rows, samples, strict=True)) and all(
        len(row) == k for r in rows for row in r or []
    ):
        teacher = torch.tensor([row for r in rows for row in r or []], dtype=torch.float32).reshape(count, k)
    else:
        teacher = torch.log_softmax(grid.flip(-1), dim=-1) - 0.1
    return teacher, student


def check_transport(
    cls: Any,
    tmp_path: str | Path | None = None,
    *,
    settings: BaseModel | Mapping[str, Any] | None = None,
    **init_kwargs: Any,
) -> None:
    """Check a :class:`~miles.transport.base.WeightTransport` class: ``connect``, ``push`` and ``close``
    are coroutines with the interface's parameters; it instantiates with its settings (in run directory
    ``tmp_path``, with ``init_kwargs`` for other constructor keywords), and a fresh instance can be closed
    without having connected. (Delivering weights needs engines: test that with a real engine in the
    transport's own tests.)"""
    check_component(ComponentKind.TRANSPORT, cls)
    where = describe(ComponentKind.TRANSPORT, cls)
    for method, params in (("connect", ("client", "dist")), ("push", ("buckets", "version", "dist")), ("close", ())):
        fn = getattr(cls, method)
        if not inspect.iscoroutinefunction(fn):
            raise failure(where, f"{method} must be a coroutine function (async def {method}(...))")
        names = set(inspect.signature(fn).parameters)
        missing = [p for p in params if p not in names]
        if missing:
            raise failure(where, f"{method} lacks the parameter(s) {', '.join(missing)} of the interface")
    import tempfile

    accepted = inspect.signature(cls.__init__).parameters
    with tempfile.TemporaryDirectory(prefix="miles-conformance-") as scratch:
        known = {"run_dir": str(tmp_path if tmp_path is not None else scratch), **_TRANSPORT_INIT, **init_kwargs}
        kwargs = {k: v for k, v in known.items() if k in accepted or k in init_kwargs}
        transport = cls(component_settings(ComponentKind.TRANSPORT, cls, settings), **kwargs)
        run_coroutine(transport.close)


def check_logger(
    cls: Any,
    tmp_path: str | Path,
    *,
    settings: BaseModel | Mapping[str, Any] | None = None,
) -> Path:
    """Check a :class:`~miles.metrics.base.MetricsLogger` class: it instantiates in the run directory
    ``tmp_path``, logs ordinary, integer and non-finite metrics over several steps, and closes (twice,
    which must be harmless).

    :returns: the run directory, for the caller to inspect what was written.
    """
    check_component(ComponentKind.LOGGER, cls)
    where = describe(ComponentKind.LOGGER, cls)
    if inspect.iscoroutinefunction(cls.log):
        raise failure(where, "log must be a plain (synchronous) method")
    run_dir = Path(tmp_path)
    logger = cls(component_settings(ComponentKind.LOGGER, cls, settings), run_dir=str(run_dir))
    try:
        logger.log(1, {"reward/mean": 0.25, "train/loss": 1.5})
        logger.log(2, {"reward/mean": 0.5, "train/tokens": 128, "train/grad_norm": float("nan")})
        logger.log(3, {})
    except Exception as exc:
        raise failure(where, f"log raised {type(exc).__name__}: {exc}") from exc
    finally:
        logger.close()
    try:
        logger.close()
    except Exception as exc:
        raise failure(where, f"a second close raised {type(exc).__name__}: {exc}") from exc
    return run_dir


def check_data_source(
    cls: Any,
    path: str | Path,
    *,
    settings: BaseModel | Mapping[str, Any] | None = None,
    batch: int = 3,
    seed: int = 7,
) -> None:
    """Check a :class:`~miles.data.base.DataSource` class on a real file ``path``: batches have the size
    asked for and hold :class:`~miles.data.base.Prompt` objects; iteration is endless (past several
    epochs of a small file); it is deterministic for a seed; ``state_dict`` is JSON-serialisable and a
    fresh source restored from it continues with exactly the same prompts.
    """
    from miles.data.base import Prompt

    check_component(ComponentKind.DATA_SOURCE, cls)
    where = describe(ComponentKind.DATA_SOURCE, cls)
    options = component_settings(ComponentKind.DATA_SOURCE, cls, settings)

    def make() -> Any:
        return cls(options, path=str(path), seed=seed, shuffle=True)

    def key(prompts: Sequence[Any]) -> list[str]:
        return [json.dumps([p.prompt, p.label], sort_keys=True, default=str) for p in prompts]

    def draw(source: Any, n: int) -> list[Any]:
        got = source.next_batch(n)
        if not (isinstance(got, list) and len(got) == n):
            raise failure(where, f"next_batch({n}) must return a list of {n} prompts, got {got!r:.200}")
        for p in got:
            if not isinstance(p, Prompt):
                raise failure(where, f"next_batch must return miles.data.base.Prompt objects, got {type(p).__name__}")
            if not isinstance(p.prompt, (str, list)):
                raise failure(where, f"Prompt.prompt must be text or chat messages, got {type(p.prompt).__name__}")
        return got

    first, second = make(), make()
    if key(draw(first, batch)) != key(draw(second, batch)):
        raise failure(where, f"two sources with seed {seed} yield different first batches (must be deterministic)")
    state = first.state_dict()
    try:
        state = json.loads(json.dumps(state))
    except (TypeError, ValueError) as exc:
        raise failure(where, f"state_dict is not JSON-serialisable: {exc}") from exc
    ahead = [key(draw(first, batch)) for _ in range(4)]
    resumed = make()
    resumed.load_state_dict(state)
    again = [key(draw(resumed, batch)) for _ in range(4)]
    if ahead != again:
        raise failure(where, "a source restored from state_dict() does not continue with the same prompts")


def check_precision(cls: Any, *, settings: BaseModel | Mapping[str, Any] | None = None) -> None:
    """Check a :class:`~miles.precision.base.PrecisionRecipe` class: its dtypes name real torch floating
    dtypes, and ``rollout_weights`` converts a small set of real weights into ``(name, tensor)`` pairs that
    keep every input name (same shape unless the recipe quantizes for the engine)."""
    import torch

    check_component(ComponentKind.PRECISION, cls)
    where = describe(ComponentKind.PRECISION, cls)
    recipe = cls(component_settings(ComponentKind.PRECISION, cls, settings))
    for attr in ("param_dtype", "reduce_dtype"):
        value = getattr(recipe, attr)
        dtype = getattr(torch, value, None) if isinstance(value, str) else None
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise failure(where, f"{attr} must name a torch floating dtype (e.g. 'bfloat16'), got {value!r}")
    generator = torch.Generator().manual_seed(0)
    weights = [
        ("model.embed_tokens.weight", torch.randn(32, 16, generator=generator)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 16, generator=generator)),
        ("model.norm.weight", torch.ones(16)),
    ]
    out = list(recipe.rollout_weights(iter([(n, t.clone()) for n, t in weights])))
    produced: dict[str, Any] = {}
    for item in out:
        if not (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise failure(where, f"rollout_weights must yield (name, tensor) pairs, got {item!r:.120}")
        produced[item[0]] = item[1]
    for name, tensor in weights:
        if name not in produced:
            raise failure(where, f"rollout_weights dropped weight {name!r}")
        if recipe.engine_quantization is None and produced[name].shape != tensor.shape:
            raise failure(
                where,
                f"rollout_weights changed the shape of {name!r} from {tuple(tensor.shape)} to {tuple(produced[name].shape)} without engine_quantization",
            )
        if not torch.isfinite(produced[name].float()).all():
            raise failure(where, f"rollout_weights produced non-finite values for {name!r}")


def check_rollout_function(fn: Any, *, name: str | None = None) -> None:
    """Check a custom rollout function (:class:`~miles.rollout.function.RolloutFunction`): an ``async``
    callable accepting ``(client, sample, sampling_params)``. (Running it needs an engine: test episodes
    against a real local engine in the function's own tests.)"""
    label = name or getattr(fn, "__qualname__", None) or type(fn).__qualname__
    where = f"rollout function {label!r}"
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", None)  # noqa: B004
    if target is None or not callable(fn):
        raise failure(where, f"must be callable, got {fn!r}")
    if not inspect.iscoroutinefunction(target):
        raise failure(where, "must be a coroutine function (async def ...(client, sample, sampling_params))")
    try:
        inspect.signature(target).bind(object(), object(), object())
    except TypeError as exc:
        raise failure(where, f"must accept (client, sample, sampling_params): {exc}") from None
