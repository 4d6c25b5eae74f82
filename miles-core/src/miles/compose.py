"""The composition root: a run's settings resolved into its components, once.

:func:`build_run` looks up every component the settings select (:class:`~miles.components.ComponentKind`
lists the kinds and the field that selects each) and validates each one's own settings; all problems are
reported together, each naming its field and where its value came from. The resulting :class:`Run` builds
the components on demand from those resolutions — ``miles train``, the trainer ranks, ``miles generate``,
``miles eval`` and the async modes all build from it, so nothing is resolved twice in a process and the
rollout stack (tokenizer, rewards, scorer, rollout manager) is assembled in one place.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.components import Component, ComponentKind, missing_requirements
from miles.errors import MilesError, PluginLoadError, SettingsError

if TYPE_CHECKING:
    from pydantic import BaseModel

    from miles.algorithms.base import Algorithm
    from miles.data.base import DataSource
    from miles.defaults import Choice, MachineFacts, ThreadSplit
    from miles.launch.base import Launcher
    from miles.metrics.base import MetricsLogger
    from miles.models import RoutedLayout
    from miles.plugins.manager import PluginManager
    from miles.plugins.registry import Registration
    from miles.precision.base import PrecisionRecipe
    from miles.rewards.scoring import NamedReward, RewardScorer, Scorer
    from miles.rollout.backend import EngineCapabilities, RolloutEngine
    from miles.rollout.client import EngineClient
    from miles.rollout.function import RolloutFunction
    from miles.rollout.manager import RolloutManager
    from miles.settings.model import MilesSettings, RolloutSettings
    from miles.training.trainer import DistContext, Trainer
    from miles.transport.base import WeightTransport

__all__ = ["ROLLOUT_KINDS", "Resolved", "Run", "build_run"]

log = logging.getLogger(__name__)

ROLLOUT_KINDS = (
    ComponentKind.LAUNCHER,
    ComponentKind.DATA_SOURCE,
    ComponentKind.ROLLOUT_ENGINE,
    ComponentKind.ROLLOUT_FUNCTION,
    ComponentKind.REWARD,
    ComponentKind.PRECISION,
)
"""What a rollout-only job (``miles generate``, ``miles eval``) uses: no trainer, transport or algorithm."""


@dataclass(frozen=True)
class Resolved:
    """One selected component: the field that selects it, its registration and its validated settings."""

    field: str
    registration: Registration[Any]
    options: BaseModel

    def create(self, *args: Any, **kwargs: Any) -> Any:
        """An instance: the component called with its settings first."""
        return self.registration.component(self.options, *args, **kwargs)


def _selections(settings: MilesSettings, kind: ComponentKind) -> Iterator[tuple[str, Any]]:
    """``(field path, value)`` of every selection of ``kind`` in ``settings`` (none when unset)."""
    value: Any = settings
    for part in kind.field.split("."):
        value = getattr(value, part)
    if kind.many:
        for i, item in enumerate(value):
            yield f"{kind.field}[{i}]", item
    elif value is not None:
        yield kind.field, value


def _import_function(ref: str, field: str) -> Any:
    module_name, _, attr = ref.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SettingsError(f"{field}: cannot load {ref!r}: {type(exc).__name__}: {exc}") from None
    if not callable(function):
        raise SettingsError(f"{field}: {ref!r} is not callable")
    return function


def build_run(
    settings: MilesSettings,
    plugins: PluginManager | None = None,
    *,
    kinds: Iterable[ComponentKind] | None = None,
    machine: MachineFacts | None = None,
) -> Run:
    """Resolve every component ``settings`` select (or those of ``kinds``: ``miles generate`` needs no
    trainer); raise one error listing every problem.

    ``precision = "auto"`` and ``transport = "auto"`` first become concrete names in ``settings``, chosen
    from ``machine`` (default: this host's facts) and the installed plugins (:mod:`miles.defaults`); the
    choices and their reasons are :attr:`Run.choices`.

    Every selected component's requirements (:meth:`~miles.components.Component.requirements`) must be
    installed: each missing one is a :class:`~miles.errors.MissingExtraError` naming the field and the extra
    that installs it. A component class may define ``check_settings(options, settings)`` (a classmethod) to
    refuse combinations with the rest of the run before anything starts (raising :class:`SettingsError`).
    """
    from miles.plugins.manager import PluginManager
    from miles.settings.loader import sources_of

    pm = plugins if plugins is not None else PluginManager().load()
    source_of = sources_of(settings).of
    wanted = tuple(ComponentKind if kinds is None else kinds)
    from miles.auto_choice import choose_automatic

    choices = choose_automatic(settings, pm, wanted, machine)
    resolved: dict[str, Resolved] = {}
    selected: dict[str, Resolved] = {}  # (with those whose requirements are missing: the cross-checks below)
    functions: dict[str, Any] = {}
    problems: list[MilesError] = []
    for kind in wanted:
        for field, value in _selections(settings, kind):
            try:
                if kind is ComponentKind.ROLLOUT_FUNCTION:  # a registered name (with its settings) or module:function
                    function, absent = _resolve_function(pm, value, field, source_of, settings)
                    problems.extend(absent)
                    if not absent:
                        functions[field] = function
                    continue
                entry, options = pm.resolve(kind, value, field=field, source_of=source_of)
                selected[field] = Resolved(field, entry, options)
                missing = missing_requirements(entry.component, options)
                if missing:
                    where = f"{field} ({source})" if (source := source_of(field)) else field
                    problems.extend(r.missing_error(f"{where}: {kind.label} {entry.name!r}") for r in missing)
                    continue
                resolved[field] = Resolved(field, entry, options)  # (checked across components below too)
                check = getattr(entry.component, "check_settings", None)
                if check is not None:
                    check(options, settings)
            except MilesError as exc:
                problems.append(exc)
    adapter, backend = selected.get("train.adapter"), selected.get("train.backend")
    if (
        adapter is not None
        and backend is not None
        and not getattr(backend.registration.component, "supports_adapters", False)
    ):
        problems.append(SettingsError(f"train.adapter: trainer {backend.registration.name!r} cannot train adapters"))
    problems.extend(_engine_serves_transport(selected))
    if {ComponentKind.TRAINER, ComponentKind.ROLLOUT_ENGINE} & set(wanted):
        from miles.models import check_model_source

        source = source_of("train.model_path")
        try:
            check_model_source(
                settings.train.model_path, where=f"train.model_path ({source})" if source else "train.model_path"
            )
        except MilesError as exc:
            problems.insert(0, exc)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        kind_of_error = PluginLoadError if any(isinstance(p, PluginLoadError) for p in problems) else SettingsError
        raise kind_of_error("\n".join(str(p) for p in problems))
    return Run(settings, pm, resolved, functions, choices)


def _engine_serves_transport(resolved: dict[str, Resolved]) -> list[SettingsError]:
    """The transport's weight routes beyond SGLang's protocol (``engine_routes``), when the selected engine
    does not serve them (an SGLang fleet and ``p2p``: the first push would fail with a 404)."""
    transport, engine = resolved.get("transport"), resolved.get("rollout.engine")
    if transport is None or engine is None:
        return []
    routes = getattr(transport.registration.component, "engine_routes", ())
    capabilities = getattr(engine.registration.component, "capabilities", None)
    needs = getattr(transport.registration.component, "engine_needs", ())
    lacking = [need for need in needs if capabilities is not None and not getattr(capabilities, need, False)]
    if lacking:
        return [
            SettingsError(
                f"transport.name: {transport.registration.name!r} needs engines that serve "
                f"{', '.join(lacking)}; rollout.engine {engine.registration.name!r} does not"
            )
        ]
    if not routes or capabilities is None or capabilities.miles_weight_routes:
        return []
    return [
        SettingsError(
            f"transport.name: {transport.registration.name!r} loads weights through routes only Miles' own engine "
            f"serves ({', '.join(routes)}); rollout.engine {engine.registration.name!r} does not serve them: "
            "use transport 'broadcast' or 'disk' with it"
        )
    ]


def _resolve_function(
    pm: PluginManager, value: Any, field: str, source_of: Callable[[str], str | None], settings: MilesSettings
) -> tuple[Any, list[MilesError]]:
    """``rollout.function``: ``package.module:function`` (imported), a registered function, or a registered
    :class:`~miles.components.Component` class, made here with its settings (the table's other keys); and the
    missing requirements of the latter (each a :class:`~miles.errors.MissingExtraError` naming the field). Its
    ``check_settings(options, settings)``, where it has one, refuses combinations before anything starts."""
    from miles.settings.model import PluginSpec

    spec = PluginSpec.model_validate(value)
    if ":" in spec.name:
        source = source_of(field)
        where = f"{field} ({source})" if source else field
        if spec.options:
            raise SettingsError(f"{where}: {spec.name!r} is imported, not registered: it takes no settings")
        return _import_function(spec.name, where), []
    entry, options = pm.resolve(ComponentKind.ROLLOUT_FUNCTION, spec, field=field, source_of=source_of)
    component = entry.component
    if not (isinstance(component, type) and issubclass(component, Component)):
        return component, []  # (a function or an instance, registered as it is: no settings but none)
    missing = missing_requirements(component, options)
    if missing:
        source = source_of(field)
        where = f"{field} ({source})" if source else field
        return None, [r.missing_error(f"{where}: rollout function {entry.name!r}") for r in missing]
    check = getattr(component, "check_settings", None)
    if check is not None:
        check(options, settings)
    return component(options), []


class Run:
    """The components of one run, resolved once; built on demand, each from its resolution.

    Components without state (precision recipe, algorithm) are built once and shared; the others are
    built where they are used (a trainer per rank, an engine launch per engine).
    """

    def __init__(
        self,
        settings: MilesSettings,
        plugins: PluginManager,
        resolved: dict[str, Resolved],
        functions: dict[str, Any] | None = None,
        choices: dict[str, Choice] | None = None,
    ) -> None:
        self.settings = settings
        self.plugins = plugins
        self.resolved = resolved
        """``{field path: Resolved}`` of every selected component."""
        self._functions = dict(functions or {})
        self.choices = dict(choices or {})
        """``{field: Choice}``: the precision and transport of the run, chosen by ``auto`` or as set, with why."""

    @property
    def thread_split(self) -> ThreadSplit:
        """The torch threads ``miles train`` gives each trainer rank and engine on this host, with why."""
        import os

        from miles.defaults import split_threads, usable_cores

        s = self.settings
        return split_threads(
            mode=s.rollout.mode,
            cores=usable_cores(),
            trainer_ranks=s.cluster.trainer_ranks,
            num_engines=s.cluster.num_engines,
            device=s.cluster.device,
            environ=os.environ,
        )

    def __getitem__(self, field: str) -> Resolved:
        try:
            return self.resolved[field]
        except KeyError:
            raise KeyError(f"{field!r} selects no component in this run") from None

    def registrations(self) -> dict[str, Registration[Any]]:
        """``{field path: registration}`` (what ``miles train --dry-run`` shows)."""
        out = {f: r.registration for f, r in self.resolved.items()}
        for field, function in self._functions.items():
            from miles.plugins.registry import Registration

            name = str(getattr(function, "name", None) or getattr(function, "__name__", function))
            out[field] = Registration(ComponentKind.ROLLOUT_FUNCTION, name, function, "(import)", _no_settings())
        return out

    def materialize_model(self) -> str:
        """Make ``train.model_path`` a Hugging Face directory (a GGUF source is converted once into the
        cache, :mod:`miles.models`) and return it; the run's settings then name that directory."""
        from miles.models import materialize

        path = self.settings.train.model_path
        if path is None:
            raise SettingsError("train.model_path: not set (the engines and the trainer load it)")
        resolved = str(materialize(path))
        if resolved != path:
            self.settings.train.model_path = resolved
            for cached in ("tokenizer", "is_moe", "eos_token_ids", "records_routed_experts"):
                self.__dict__.pop(cached, None)
        return resolved

    # -- stateless components, built once --------------------------------------------------------------
    @functools.cached_property
    def precision(self) -> PrecisionRecipe:
        recipe: PrecisionRecipe = self["precision"].create()
        return recipe

    @functools.cached_property
    def algorithm(self) -> Algorithm:
        algorithm: Algorithm = self["algorithm"].create()
        return algorithm

    @property
    def engine_dtype(self) -> str:
        """The dtype engines serve: ``rollout.engine_dtype``, or the precision recipe's parameter dtype."""
        wanted = self.settings.rollout.engine_dtype
        return self.precision.param_dtype if wanted == "auto" else wanted

    @property
    def rollout_function(self) -> RolloutFunction | None:
        """``rollout.function``, or ``None`` for the default single-turn generate."""
        function: RolloutFunction | None = self._functions.get("rollout.function")
        return function

    def set_rollout_function(self, function: RolloutFunction) -> None:
        """Replace ``rollout.function``'s instance (with the URL of the server the launcher started for it)."""
        self._functions["rollout.function"] = function

    # -- components built where they are used -----------------------------------------------------
    def trainer(self, dist: DistContext) -> Trainer:
        entry = self["train.backend"]
        trainer: Trainer = entry.registration.component(self.settings.train, entry.options, self.precision, dist)
        if "train.adapter" in self.resolved:
            if not trainer.supports_adapters:
                raise SettingsError(f"train.adapter: trainer {trainer.name!r} cannot train adapters")
            trainer.adapter = self["train.adapter"].create()
        return trainer

    def transport(self) -> WeightTransport:
        s = self.settings
        transport: WeightTransport = self["transport"].create(
            run_dir=s.log.run_dir, model_path=s.train.model_path, engine_dtype=self.engine_dtype
        )
        if "rollout.engine" in self.resolved:  # a run built for the transport alone leaves it unknown (None)
            transport.engine_capabilities = self.engine_capabilities
        return transport

    @property
    def engine_capabilities(self) -> EngineCapabilities:
        """What the selected rollout engine supports (its class's ``capabilities``)."""
        capabilities: EngineCapabilities = self["rollout.engine"].registration.component.capabilities
        return capabilities

    def rollout_engine(self) -> RolloutEngine:
        """The rollout engine, told the weight format of the precision recipe (``engine_quantization``), the
        shape of the run's LoRA adapter (``train.adapter``) and whether rollouts record routed experts."""
        engine: RolloutEngine = self["rollout.engine"].create()
        engine.records_routed_experts = self.records_routed_experts
        if "train.adapter" in self.resolved:
            engine.adapter = self["train.adapter"].create().low_rank()
        wanted = self.precision.engine_quantization
        if wanted is None:
            return engine
        if "quantization" not in type(engine.settings).model_fields:
            raise SettingsError(
                f"precision: {self.precision.name!r} sends {wanted} weights, which rollout engine "
                f"{engine.name!r} cannot load (it has no quantization setting); use the local engine"
            )
        current = getattr(engine.settings, "quantization", None)
        if current not in (None, wanted):
            raise SettingsError(
                f"rollout.engine.quantization = {current!r} contradicts precision {self.precision.name!r} "
                f"(which sends {wanted} weights): leave it unset"
            )
        engine.settings = engine.settings.model_copy(update={"quantization": wanted})
        return engine

    def launcher(self, *, run_dir: str | None = None) -> Launcher:
        """The launcher, its process logs under ``run_dir`` (default ``log.run_dir``)."""
        launcher: Launcher = self["cluster.launcher"].create(run_dir=run_dir or self.settings.log.run_dir)
        return launcher

    def loggers(self) -> list[MetricsLogger]:
        run_dir = self.settings.log.run_dir
        return [self[f"log.loggers[{i}]"].create(run_dir=run_dir) for i in range(len(self.settings.log.loggers))]

    def rewards(self) -> list[NamedReward]:
        """``reward.functions`` as ``(name, reward, weight)``; a name used twice gets a suffix (``regex_2``)."""
        out: list[NamedReward] = []
        seen: dict[str, int] = {}
        for i, spec in enumerate(self.settings.reward.functions):
            reward = self[f"reward.functions[{i}]"].create()
            seen[spec.name] = seen.get(spec.name, 0) + 1
            name = spec.name if seen[spec.name] == 1 else f"{spec.name}_{seen[spec.name]}"
            out.append((name, reward, spec.weight))
        return out

    def data_source(self, tokenizer: Any, *, path: str | None = None, shuffle: bool | None = None) -> DataSource:
        """The prompt source with its tokenising pipeline (chat template applied once).

        :param path: read this file instead of ``data.path`` (an eval set); ``shuffle`` overrides
            ``data.shuffle``.
        """
        from miles.data.factory import create_data_source

        data = self.settings.data
        updates = {k: v for k, v in (("path", path), ("shuffle", shuffle)) if v is not None}
        if updates:
            data = data.model_copy(update=updates)
        model_path = self.settings.train.model_path
        return create_data_source(self["data.source"].create, data, tokenizer=tokenizer, model_path=model_path)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The policy's tokenizer (``train.model_path``; of a diffusers pipeline directory, its prompt
        tokenizer, ``tokenizer/``)."""
        from pathlib import Path

        from transformers import AutoTokenizer

        path = self.settings.train.model_path
        if path is None:
            raise SettingsError("train.model_path: not set (the engines and the trainer load it)")
        if (Path(path) / "model_index.json").exists() and (Path(path) / "tokenizer").is_dir():
            return AutoTokenizer.from_pretrained(Path(path) / "tokenizer")
        return AutoTokenizer.from_pretrained(path)

    # -- the rollout stack ---------------------------------------------------------------------------
    def scorer(self) -> RewardScorer:
        """The ``reward.functions`` as a scorer (fresh instances: close it when done) with the ``reward``
        settings' timeout and one concurrency bound."""
        from miles.rewards.scoring import RewardScorer

        reward = self.settings.reward
        return RewardScorer(self.rewards(), timeout=reward.timeout, max_concurrency=reward.max_concurrency)

    def rollout_manager(
        self,
        client: EngineClient,
        scorer: Scorer,
        *,
        rollout: RolloutSettings | None = None,
        seed_offset: int = 0,
        filter_groups: bool = True,
    ) -> RolloutManager:
        """The rollout manager over ``client``: ``rollout`` settings (default the run's), the rollout
        function, seeds from ``train.seed + seed_offset`` and, with ``filter_groups``, the algorithm's
        dynamic-sampling filter (and teacher scoring when it needs a teacher)."""
        from miles.rollout.manager import RolloutManager

        settings = rollout or self.settings.rollout
        return RolloutManager(
            client,
            settings,
            scorer=scorer,
            algorithm=self.algorithm if filter_groups else None,
            rollout_function=self.rollout_function,
            seed=self.settings.train.seed + seed_offset,
            return_routed_experts=self.records_routed_experts,
            routed_layout=self.routed_layout,
            eos_token_ids=self.eos_token_ids,
        )

    @functools.cached_property
    def is_moe(self) -> bool:
        """Whether the policy routes tokens to experts (its rollouts then record the routed experts)."""
        from pathlib import Path

        from miles.models import is_moe_model

        path = self.settings.train.model_path
        return path is not None and (Path(path) / "config.json").is_file() and is_moe_model(path)

    @functools.cached_property
    def routed_layout(self) -> RoutedLayout | None:
        """Where the policy's routers are (``None``: a dense model), to read routed experts from engines that
        send them without a shape (SGLang)."""
        from pathlib import Path

        from miles.models import routed_layout

        path = self.settings.train.model_path
        return routed_layout(path) if path is not None and (Path(path) / "config.json").is_file() else None

    @functools.cached_property
    def records_routed_experts(self) -> bool:
        """Whether rollouts ask the engines for the experts they routed each token to: MoE policies (or
        ``train.routing_replay``) on an engine whose capabilities say it reports them."""
        if not (self.settings.train.routing_replay or self.is_moe):
            return False
        entry = self.resolved.get("rollout.engine")
        capabilities = getattr(entry.registration.component, "capabilities", None) if entry else None
        if capabilities is None or capabilities.routed_experts:
            return True
        log.warning(
            "rollout.engine %r does not report routed experts: no routing replay or routing agreement this run%s",
            entry.registration.name if entry else "?",
            " (train.routing_replay has nothing to replay)" if self.settings.train.routing_replay else "",
        )
        return False

    @functools.cached_property
    def eos_token_ids(self) -> list[int]:
        """The policy's EOS ids (what the engines stop on and mask before ``min_new_tokens``)."""
        from pathlib import Path

        from miles.models import eos_token_ids

        path = self.settings.train.model_path
        if path is None or not (Path(path) / "config.json").is_file():
            return []
        return eos_token_ids(path, tokenizer=self.tokenizer)


@functools.cache
def _no_settings() -> type[BaseModel]:
    from miles.components import ComponentSettings

    return ComponentSettings
