"""The plugin conformance kit: checks a plugin author runs from their own tests.

Each check exercises the plugin through the real :class:`~miles.plugins.PluginManager` and the real
component interfaces, and raises :class:`AssertionError` with a message that names the plugin, the
component and what is wrong::

    from miles.testing import check_plugin, check_reward
    import miles_my_reward.plugin as plugin

    def test_conforms():
        (entry,) = check_plugin(plugin, name="my_reward")
        check_reward(entry.component)

:func:`check_plugin` checks the plugin as a whole (hooks, names, settings models);
:func:`check_entry_point` checks the installed distribution; the per-kind checks
(:func:`check_reward`, :func:`check_algorithm`, :func:`check_transport`, :func:`check_logger`,
:func:`check_data_source`, :func:`check_precision`) run one component against its interface.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import inspect
import json
import math
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, get_args

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import PydanticUndefined

from miles import hookspecs
from miles.components import ComponentKind
from miles.errors import MilesError
from miles.plugins.builtin import BUILTIN_PLUGINS
from miles.plugins.manager import ENTRY_POINT_GROUP, PluginManager, PluginRecord
from miles.types import Sample, SampleGroup, SampleStatus

if TYPE_CHECKING:
    from miles.plugins.registry import Registration

__all__ = [
    "check_algorithm",
    "check_component",
    "check_data_source",
    "check_entry_point",
    "check_light_import",
    "check_logger",
    "check_plugin",
    "check_precision",
    "check_reward",
    "check_rollout_function",
    "check_settings_model",
    "check_transport",
    "example_groups",
    "example_samples",
]

T = TypeVar("T")

_BASES: dict[ComponentKind, tuple[str, str]] = {
    ComponentKind.ROLLOUT_ENGINE: ("miles.rollout.engine", "RolloutEngine"),
    ComponentKind.TRAINER: ("miles.training.trainer", "Trainer"),
    ComponentKind.TRANSPORT: ("miles.transport.base", "WeightTransport"),
    ComponentKind.PRECISION: ("miles.precision.base", "PrecisionRecipe"),
    ComponentKind.ALGORITHM: ("miles.algorithms.base", "Algorithm"),
    ComponentKind.REWARD: ("miles.rewards.base", "Reward"),
    ComponentKind.DATA_SOURCE: ("miles.data.base", "DataSource"),
    ComponentKind.LAUNCHER: ("miles.launch.base", "Launcher"),
    ComponentKind.LOGGER: ("miles.metrics.base", "MetricsLogger"),
}
"""The base class each kind of component derives from (rollout functions are plain callables)."""


def _fail(where: str, what: str) -> AssertionError:
    return AssertionError(f"{where}: {what}")


def _where(kind: ComponentKind, component: Any) -> str:
    name = getattr(component, "name", None)
    label = getattr(component, "__qualname__", None) or type(component).__qualname__
    return f"{kind.label} {name!r} ({label})" if name else f"{kind.label} {label}"


def _run(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion, also when the caller is already inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())  # type: ignore[arg-type]
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(factory()))  # type: ignore[arg-type]
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="miles-conformance")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


# -- the plugin as a whole ---------------------------------------------------------------------------


def _undecorated_hooks(plugin: object) -> list[str]:
    """Functions named like a hook that pluggy will ignore because they lack ``@miles.hookimpl``."""
    known = set(hookspecs.REGISTRATION_HOOKS) | {n for n in dir(hookspecs) if n.startswith("miles_on_")}
    found = []
    for attr in dir(plugin):
        if not attr.startswith("miles_"):
            continue
        value = getattr(plugin, attr, None)
        if not callable(value) or hasattr(value, "miles_impl"):
            continue
        if attr in known or attr.startswith(("miles_register_", "miles_on_")):
            found.append(attr)
    return sorted(found)


def _bad_hook_arguments(plugin: object) -> list[str]:
    """Hook implementations that ask for arguments their hook specification does not provide."""
    problems = []
    for attr in dir(plugin):
        value = getattr(plugin, attr, None)
        spec = getattr(hookspecs, attr, None)
        if not attr.startswith("miles_") or not callable(value) or not hasattr(value, "miles_impl") or spec is None:
            continue
        provided = list(inspect.signature(spec).parameters)
        wanted = [
            p.name
            for p in inspect.signature(value).parameters.values()
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        unknown = [w for w in wanted if w not in provided]
        if unknown:
            problems.append(
                f"{attr} asks for argument(s) {', '.join(unknown)} that the hook does not provide "
                f"(it provides: {', '.join(provided)})"
            )
    return problems


def _registrations(manager: PluginManager, plugin_name: str) -> list[Registration[Any]]:
    out = []
    for kind in ComponentKind:
        out += [entry for entry in manager.registry(kind) if entry.plugin == plugin_name]
    return out


def check_plugin(
    plugin: object,
    *,
    name: str,
    builtins: Sequence[tuple[str, str]] | None = None,
    expect: Iterable[tuple[str, str]] | None = None,
) -> list[Registration[Any]]:
    """Check that ``plugin`` (a module or object with hook implementations) is a well-formed plugin.

    It is registered as ``name`` in a fresh :class:`~miles.plugins.PluginManager` next to the built-in
    plugins (so a name that collides with a built-in is caught), without entry points. Checked:
    every ``miles_*`` hook it implements exists and is decorated with ``@miles.hookimpl``; it implements at
    least one hook; its registration hooks run without error, register valid, unique names, and register
    the same components every time they are called; each registered class derives from its kind's base
    class, implements every abstract method and has a docstring; each settings model passes
    :func:`check_settings_model`.

    :param plugin: the plugin module or object.
    :param name: the plugin name (the entry-point name it is published under).
    :param builtins: the built-in plugins to load next to it (default: every built-in except ``plugin``).
    :param expect: ``(kind, name)`` pairs the plugin must register, e.g. ``[("reward", "keyword")]``.
    :returns: the plugin's registrations (kind, name, component, settings model).
    """
    where = f"plugin {name!r}"
    undecorated = _undecorated_hooks(plugin)
    if undecorated:
        raise _fail(where, f"{', '.join(undecorated)} not decorated with @miles.hookimpl (pluggy ignores it)")
    bad_arguments = _bad_hook_arguments(plugin)
    if bad_arguments:
        raise _fail(where, "; ".join(bad_arguments))
    if builtins is None:
        module_name = getattr(plugin, "__name__", None)
        builtins = [(n, m) for n, m in BUILTIN_PLUGINS if m != module_name and n != name]
    manager = PluginManager(builtins=builtins, entry_points=False, disabled=(), only=())
    try:
        manager.register(plugin, name)
    except MilesError as exc:
        raise _fail(where, f"does not load: {str(exc).removeprefix(f'{where}: ')}") from exc
    record = next(r for r in manager.records() if r.name == name)
    if record.status != "ok":
        detail = f"\n{record.traceback}" if record.traceback else ""
        raise _fail(where, f"status {record.status}: {record.error}{detail}")
    if not record.hooks:
        raise _fail(where, "implements no Miles hook (expected functions decorated with @miles.hookimpl)")
    entries = _registrations(manager, name)

    again = PluginManager(builtins=builtins, entry_points=False, disabled=(), only=())
    again.register(plugin, name)
    first = sorted((e.kind.value, e.name) for e in entries)
    second = sorted((e.kind.value, e.name) for e in _registrations(again, name))
    again.unregister(name)
    again.register(plugin, name)
    second_again = sorted((e.kind.value, e.name) for e in _registrations(again, name))
    if not (first == second == second_again):
        raise _fail(where, "registration hooks register different components on each call; they must be pure")

    for entry in entries:
        check_component(entry.kind, entry.component, plugin=name)
    if expect is not None:
        have = {(e.kind.value, e.name) for e in entries}
        missing = sorted({(ComponentKind(k).value, n) for k, n in expect} - have)
        if missing:
            listed = ", ".join(f"{k} {n!r}" for k, n in missing)
            got = ", ".join(f"{k} {n!r}" for k, n in sorted(have)) or "nothing"
            raise _fail(where, f"does not register {listed} (registers {got})")
    return entries


def check_component(kind: ComponentKind | str, component: Any, *, plugin: str = "?") -> None:
    """Check one registered component: base class, abstract methods, docstring, settings model."""
    kind = ComponentKind(kind)
    where = f"plugin {plugin!r}, {_where(kind, component)}"
    if kind in _BASES:
        module, attr = _BASES[kind]
        base = getattr(importlib.import_module(module), attr)
        if not (isinstance(component, type) and issubclass(component, base)):
            raise _fail(where, f"must be a class deriving from {module}.{attr}, got {component!r}")
        if inspect.isabstract(component):
            missing = ", ".join(sorted(getattr(component, "__abstractmethods__", ())))
            raise _fail(where, f"does not implement the abstract method(s) {missing}")
    elif not callable(component):
        raise _fail(where, f"must be callable, got {component!r}")
    if not (getattr(component, "__doc__", None) or "").strip():
        raise _fail(where, "has no docstring (its first line is the description in `miles plugins list`)")
    check_settings_model(getattr(component, "Settings", None) or _default_settings(), where=where)


def _default_settings() -> type[BaseModel]:
    from miles.components import ComponentSettings

    return ComponentSettings


def check_settings_model(model: Any, *, where: str = "settings") -> None:
    """Check a component's ``Settings``: a pydantic model that rejects unknown keys, every field has a
    description (an attribute docstring with ``use_attribute_docstrings``, or ``Field(description=...)``),
    and every default validates against its field's type and constraints."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise _fail(where, f"Settings must be a pydantic BaseModel subclass, got {model!r}")
    qual = f"{where}: Settings {model.__qualname__}"
    if model.model_config.get("extra") != "forbid":
        raise AssertionError(
            f"{qual} accepts unknown keys (a typo would pass silently); derive it from "
            "miles.components.ComponentSettings or set extra='forbid'"
        )
    for field_name, info in model.model_fields.items():
        if not (info.description or "").strip():
            raise AssertionError(
                f"{qual}: field {field_name!r} has no docstring (it is the field's documentation and CLI help)"
            )
        if info.is_required():
            continue
        default = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
        if default is PydanticUndefined:
            continue
        annotation: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        try:
            TypeAdapter(annotation).validate_python(default, strict=False)
        except ValidationError as exc:
            first = exc.errors()[0]["msg"]
            raise AssertionError(
                f"{qual}: default of field {field_name!r} ({default!r}) does not validate: {first}"
            ) from None


def _settings_for(kind: ComponentKind, cls: Any, settings: BaseModel | Mapping[str, Any] | None) -> BaseModel:
    where = _where(kind, cls)
    model = getattr(cls, "Settings", None) or _default_settings()
    check_settings_model(model, where=where)
    if isinstance(settings, BaseModel):
        if not isinstance(settings, model):
            raise _fail(where, f"settings must be a {model.__qualname__}, got {type(settings).__qualname__}")
        return settings
    try:
        return model.model_validate(dict(settings or {}))
    except ValidationError as exc:
        hint = "" if settings else " (pass settings= for fields without a default)"
        raise _fail(
            where, f"settings do not validate{hint}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}"
        ) from None


# -- entry points ------------------------------------------------------------------------------------


def check_entry_point(name: str, *, distribution: str | None = None) -> PluginRecord:
    """Check that an installed distribution exposes plugin ``name`` in the ``miles.plugins`` entry-point
    group and that the real plugin manager loads it with status ``ok`` (then :func:`check_plugin` on it).

    :param name: the entry-point (plugin) name.
    :param distribution: the distribution that must provide it (e.g. ``miles-reward-example``).
    :returns: the manager's record (distribution, version, what it registers, hooks).
    """
    where = f"entry point {name!r} (group {ENTRY_POINT_GROUP!r})"
    found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        raise _fail(where, "not installed; is the distribution installed (pip install -e .) and is the name right?")
    dists = sorted({ep.dist.metadata["Name"] for ep in found if ep.dist is not None})
    if distribution is not None and distribution not in dists:
        raise _fail(where, f"provided by {', '.join(dists) or '?'}, expected distribution {distribution!r}")
    manager = PluginManager(entry_points=True, disabled=(), only=(name,))
    record = next((r for r in manager.records() if r.name == name), None)
    if record is None:
        raise _fail(where, "the plugin manager did not see it")
    if record.status != "ok":
        detail = f"\n{record.traceback}" if record.traceback else ""
        raise _fail(where, f"loads with status {record.status}: {record.error}{detail}")
    if record.builtin:
        raise _fail(where, "has the name of a built-in plugin")
    check_plugin(found[0].load(), name=name)
    return record


def check_light_import(module: str, *, forbidden: Sequence[str] = ("torch", "transformers")) -> None:
    """Check, in a fresh interpreter, that importing the plugin module ``module`` does not import any of
    ``forbidden``: ``miles plugins list`` imports every plugin, so entry modules must be cheap."""
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps(sorted(m for m in {list(forbidden)!r} if m in sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"plugin module {module!r}: import fails:\n{proc.stderr.strip()}")
    heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    if heavy:
        raise AssertionError(
            f"plugin module {module!r}: importing it imports {', '.join(heavy)}; import heavy modules inside the "
            "functions that use them"
        )


# -- example data ------------------------------------------------------------------------------------


def example_samples() -> list[Sample]:
    """A few completed samples a reward must score without raising: an ordinary answer, an empty
    response, non-ASCII text, a sample without a label, a truncated one."""

    def sample(i: int, prompt: str, response: str, label: Any, status: SampleStatus = SampleStatus.COMPLETED) -> Sample:
        n = max(1, len(response.split())) if response else 0
        return Sample(
            prompt_ids=[1, 2, 3, 4 + i],
            response_ids=[10 + k for k in range(n)],
            rollout_logprobs=[-0.5] * n,
            loss_mask=[1] * n,
            status=status,
            group_id=0,
            index=i,
            prompt=prompt,
            response=response,
            label=label,
        )

    return [
        sample(0, "What is 6 x 7?", "6 x 7 = 42. The answer is \\boxed{42}.", "42"),
        sample(1, "What is 6 x 7?", "", "42"),
        sample(2, "Wie viel ist 6 mal 7?", "Die Antwort ist zweiundvierzig (42) ✓", "42"),
        sample(3, "Say hello.", "Hello there!", None),
        sample(4, "Count to ten.", "one two three four five", "ten", SampleStatus.TRUNCATED),
    ]


def example_groups(num_groups: int = 2, group_size: int = 4, seed: int = 0) -> list[SampleGroup]:
    """Scored sample groups with varied response lengths, rewards, logprobs and a masked (tool) span."""
    import random

    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        samples = []
        for i in range(group_size):
            n = rng.randint(2, 9)
            mask = [1] * n
            if n > 4 and i % 2:
                mask[1:3] = [0, 0]  # tokens the environment inserted
            samples.append(
                Sample(
                    prompt_ids=[rng.randint(5, 100) for _ in range(rng.randint(2, 6))],
                    response_ids=[rng.randint(5, 100) for _ in range(n)],
                    rollout_logprobs=[0.0 if m == 0 else -rng.uniform(0.05, 3.0) for m in mask],
                    loss_mask=mask,
                    reward=float(rng.random() > 0.5) if g % 2 == 0 else rng.uniform(-1, 1),
                    status=SampleStatus.COMPLETED,
                    group_id=g,
                    index=i,
                    teacher_logprobs=[-rng.uniform(0.05, 3.0) for _ in range(n)],
                )
            )
        groups.append(SampleGroup(g, samples))
    return groups


# -- per kind ----------------------------------------------------------------------------------------


def check_reward(
    cls: Any,
    *,
    samples: Sequence[Sample] | None = None,
    settings: BaseModel | Mapping[str, Any] | None = None,
) -> list[float]:
    """Check a :class:`~miles.rewards.base.Reward` class: it instantiates with ``settings`` (default: its
    settings model's defaults), ``score`` and ``close`` are coroutines, and every sample gets a finite float
    or a :class:`~miles.rewards.base.RewardOutput` with finite value and parts.

    :param samples: samples to score (default :func:`example_samples`).
    :returns: the rewards' values, one per sample.
    """
    from miles.rewards.base import Reward, RewardOutput

    check_component(ComponentKind.REWARD, cls)
    where = _where(ComponentKind.REWARD, cls)
    for method in ("score", "close"):
        if not inspect.iscoroutinefunction(getattr(cls, method)):
            raise _fail(where, f"{method} must be a coroutine function (async def {method}(...)), it is synchronous")
    options = _settings_for(ComponentKind.REWARD, cls, settings)
    reward: Reward = cls(options)
    todo = list(samples) if samples is not None else example_samples()

    async def score_all() -> list[Any]:
        try:
            return [await reward.score(s) for s in todo]
        finally:
            await reward.close()

    values = []
    for i, result in enumerate(_run(score_all)):
        at = f"{where}: score(sample {i}, response={todo[i].response[:40]!r})"
        if isinstance(result, RewardOutput):
            value = result.value
            for part, part_value in result.parts.items():
                if (
                    not isinstance(part, str)
                    or isinstance(part_value, bool)
                    or not isinstance(part_value, (int, float))
                ):
                    raise AssertionError(
                        f"{at}: RewardOutput.parts must map str to float, got {part!r}: {part_value!r}"
                    )
                if not math.isfinite(part_value):
                    raise AssertionError(f"{at}: RewardOutput.parts[{part!r}] is not finite: {part_value!r}")
        else:
            value = result
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise AssertionError(f"{at}: must return a float or a RewardOutput, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise AssertionError(f"{at}: returned a non-finite reward {value!r}")
        values.append(float(value))
    return values


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

    from miles.algorithms.base import Aggregation, AlgorithmNeeds, LossInputs, LossOutput

    check_component(ComponentKind.ALGORITHM, cls)
    where = _where(ComponentKind.ALGORITHM, cls)
    algo = cls(_settings_for(ComponentKind.ALGORITHM, cls, settings))
    groups = list(groups) if groups is not None else example_groups()
    needs = algo.needs
    if not isinstance(needs, AlgorithmNeeds):
        raise _fail(where, f"needs must be an AlgorithmNeeds, got {type(needs).__name__}")
    if algo.aggregation not in get_args(Aggregation):
        raise _fail(where, f"aggregation {algo.aggregation!r} is not one of {', '.join(get_args(Aggregation))}")
    norm = algo.seq_len_norm
    if not (isinstance(norm, (int, float)) and math.isfinite(norm) and norm > 0):
        raise _fail(where, f"seq_len_norm must be a positive finite number, got {norm!r}")
    keep = algo.keep_groups(groups)
    if not (isinstance(keep, list) and len(keep) == len(groups) and all(isinstance(k, bool) for k in keep)):
        raise _fail(where, f"keep_groups must return one bool per group ({len(groups)}), got {keep!r}")

    lengths = [[s.response_length for s in g] for g in groups]
    values = [[torch.linspace(-0.5, 0.5, n) for n in row] for row in lengths] if needs.values else None
    extra: dict[str, Any] = {}
    if getattr(needs, "ref_logprobs_for_advantages", False):
        extra["ref_logprobs"] = [[torch.tensor(s.rollout_logprobs) - 0.1 for s in g.samples] for g in groups]
    advantages = algo.compute_advantages(groups, values, **extra)
    if not (isinstance(advantages, list) and len(advantages) == len(groups)):
        raise _fail(
            where,
            f"compute_advantages must return one list per group ({len(groups)}), got {type(advantages).__name__} of {len(advantages) if isinstance(advantages, list) else '?'}",
        )
    for g, (row, expected) in enumerate(zip(advantages, lengths, strict=True)):
        if not (isinstance(row, list) and len(row) == len(expected)):
            raise _fail(where, f"compute_advantages: group {g} must have one tensor per sample ({len(expected)})")
        for i, (adv, n) in enumerate(zip(row, expected, strict=True)):
            if not isinstance(adv, torch.Tensor) or adv.shape != (n,):
                shape = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
                raise _fail(
                    where,
                    f"compute_advantages: group {g} sample {i} must be a tensor of shape ({n},) (its response length), got {shape}",
                )
            if not torch.isfinite(adv).all():
                raise _fail(where, f"compute_advantages: group {g} sample {i} has non-finite values")

    returns = None
    if needs.values and hasattr(algo, "compute_returns"):
        returns = algo.compute_returns(groups, values, **extra)
        if returns is not None:
            flat = [r for row in returns for r in row]
            if [tuple(r.shape) for r in flat] != [(n,) for row in lengths for n in row]:
                raise _fail(where, "compute_returns must return one tensor per sample with its response length")
    samples = [s for g in groups for s in g.samples]

    def cat(rows: Iterable[Sequence[float]]) -> torch.Tensor:
        return torch.tensor([v for row in rows for v in row], dtype=torch.float32)

    rollout = cat(s.rollout_logprobs for s in samples)
    shift = torch.linspace(-0.2, 0.2, rollout.numel())
    logprobs = (rollout + shift).requires_grad_(True)
    mask = cat(s.loss_mask for s in samples)
    count = rollout.numel()
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
        raise _fail(where, f"loss must return a LossOutput, got {type(out).__name__}")
    loss = out.per_token_loss
    if not isinstance(loss, torch.Tensor) or loss.shape != (count,):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise _fail(where, f"loss: per_token_loss must have shape [T] = ({count},), got {shape}")
    if not torch.isfinite(loss).all():
        raise _fail(where, "loss: per_token_loss has non-finite values")
    for key, metric in out.metrics.items():
        if not isinstance(metric, torch.Tensor) or metric.shape != (count,):
            shape = tuple(metric.shape) if isinstance(metric, torch.Tensor) else type(metric).__name__
            raise _fail(where, f"loss: metric {key!r} must be a per-token tensor of shape ({count},), got {shape}")
    if needs.rollout and loss.requires_grad:
        (loss * mask).sum().backward()
        if logprobs.grad is None or not torch.isfinite(logprobs.grad).all():
            raise _fail(where, "loss: gradients do not flow (finitely) to the logprobs")
    elif not loss.requires_grad:
        raise _fail(where, "loss: per_token_loss does not depend on the logprobs (no gradient)")


_TRANSPORT_INIT = {"model_path": None, "engine_dtype": "float32"}
"""Constructor keywords of :class:`~miles.transport.base.WeightTransport` besides ``run_dir``."""


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
    where = _where(ComponentKind.TRANSPORT, cls)
    for method, params in (("connect", ("client", "dist")), ("push", ("buckets", "version", "dist")), ("close", ())):
        fn = getattr(cls, method)
        if not inspect.iscoroutinefunction(fn):
            raise _fail(where, f"{method} must be a coroutine function (async def {method}(...))")
        names = set(inspect.signature(fn).parameters)
        missing = [p for p in params if p not in names]
        if missing:
            raise _fail(where, f"{method} lacks the parameter(s) {', '.join(missing)} of the interface")
    import tempfile

    accepted = inspect.signature(cls.__init__).parameters
    with tempfile.TemporaryDirectory(prefix="miles-conformance-") as scratch:
        known = {"run_dir": str(tmp_path if tmp_path is not None else scratch), **_TRANSPORT_INIT, **init_kwargs}
        kwargs = {k: v for k, v in known.items() if k in accepted or k in init_kwargs}
        transport = cls(_settings_for(ComponentKind.TRANSPORT, cls, settings), **kwargs)
        _run(transport.close)


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
    where = _where(ComponentKind.LOGGER, cls)
    if inspect.iscoroutinefunction(cls.log):
        raise _fail(where, "log must be a plain (synchronous) method")
    run_dir = Path(tmp_path)
    logger = cls(_settings_for(ComponentKind.LOGGER, cls, settings), run_dir=str(run_dir))
    try:
        logger.log(1, {"reward/mean": 0.25, "train/loss": 1.5})
        logger.log(2, {"reward/mean": 0.5, "train/tokens": 128, "train/grad_norm": float("nan")})
        logger.log(3, {})
    except Exception as exc:
        raise _fail(where, f"log raised {type(exc).__name__}: {exc}") from exc
    finally:
        logger.close()
    try:
        logger.close()
    except Exception as exc:
        raise _fail(where, f"a second close raised {type(exc).__name__}: {exc}") from exc
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
    where = _where(ComponentKind.DATA_SOURCE, cls)
    options = _settings_for(ComponentKind.DATA_SOURCE, cls, settings)

    def make() -> Any:
        return cls(options, path=str(path), seed=seed, shuffle=True)

    def key(prompts: Sequence[Any]) -> list[str]:
        return [json.dumps([p.prompt, p.label], sort_keys=True, default=str) for p in prompts]

    def draw(source: Any, n: int) -> list[Any]:
        got = source.next_batch(n)
        if not (isinstance(got, list) and len(got) == n):
            raise _fail(where, f"next_batch({n}) must return a list of {n} prompts, got {got!r:.200}")
        for p in got:
            if not isinstance(p, Prompt):
                raise _fail(where, f"next_batch must return miles.data.base.Prompt objects, got {type(p).__name__}")
            if not isinstance(p.prompt, (str, list)):
                raise _fail(where, f"Prompt.prompt must be text or chat messages, got {type(p.prompt).__name__}")
        return got

    first, second = make(), make()
    if key(draw(first, batch)) != key(draw(second, batch)):
        raise _fail(where, f"two sources with seed {seed} yield different first batches (must be deterministic)")
    state = first.state_dict()
    try:
        state = json.loads(json.dumps(state))
    except (TypeError, ValueError) as exc:
        raise _fail(where, f"state_dict is not JSON-serialisable: {exc}") from exc
    ahead = [key(draw(first, batch)) for _ in range(4)]
    resumed = make()
    resumed.load_state_dict(state)
    again = [key(draw(resumed, batch)) for _ in range(4)]
    if ahead != again:
        raise _fail(where, "a source restored from state_dict() does not continue with the same prompts")


def check_precision(cls: Any, *, settings: BaseModel | Mapping[str, Any] | None = None) -> None:
    """Check a :class:`~miles.precision.base.PrecisionRecipe` class: its dtypes name real torch floating
    dtypes, and ``rollout_weights`` converts a small set of real weights into ``(name, tensor)`` pairs that
    keep every input name (same shape unless the recipe quantizes for the engine)."""
    import torch

    check_component(ComponentKind.PRECISION, cls)
    where = _where(ComponentKind.PRECISION, cls)
    recipe = cls(_settings_for(ComponentKind.PRECISION, cls, settings))
    for attr in ("param_dtype", "reduce_dtype"):
        value = getattr(recipe, attr)
        dtype = getattr(torch, value, None) if isinstance(value, str) else None
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise _fail(where, f"{attr} must name a torch floating dtype (e.g. 'bfloat16'), got {value!r}")
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
            raise _fail(where, f"rollout_weights must yield (name, tensor) pairs, got {item!r:.120}")
        produced[item[0]] = item[1]
    for name, tensor in weights:
        if name not in produced:
            raise _fail(where, f"rollout_weights dropped weight {name!r}")
        if recipe.engine_quantization is None and produced[name].shape != tensor.shape:
            raise _fail(
                where,
                f"rollout_weights changed the shape of {name!r} from {tuple(tensor.shape)} to {tuple(produced[name].shape)} without engine_quantization",
            )
        if not torch.isfinite(produced[name].float()).all():
            raise _fail(where, f"rollout_weights produced non-finite values for {name!r}")


def check_rollout_function(fn: Any, *, name: str | None = None) -> None:
    """Check a custom rollout function (:class:`~miles.rollout.function.RolloutFunction`): an ``async``
    callable accepting ``(client, sample, sampling_params)``. (Running it needs an engine: test episodes
    against a real local engine in the function's own tests.)"""
    label = name or getattr(fn, "__qualname__", None) or type(fn).__qualname__
    where = f"rollout function {label!r}"
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", None)  # noqa: B004
    if target is None or not callable(fn):
        raise _fail(where, f"must be callable, got {fn!r}")
    if not inspect.iscoroutinefunction(target):
        raise _fail(where, "must be a coroutine function (async def ...(client, sample, sampling_params))")
    try:
        inspect.signature(target).bind(object(), object(), object())
    except TypeError as exc:
        raise _fail(where, f"must accept (client, sample, sampling_params): {exc}") from None
