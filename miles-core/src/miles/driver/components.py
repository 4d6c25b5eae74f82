"""Build the run's components from settings through the plugin manager (one place, named fields)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from miles.components import ComponentKind
from miles.errors import SettingsError

if TYPE_CHECKING:
    from miles.algorithms.base import Algorithm
    from miles.data.base import DataSource
    from miles.metrics.base import MetricsLogger
    from miles.plugins.manager import PluginManager
    from miles.precision.base import PrecisionRecipe
    from miles.rollout.engine import RolloutEngine
    from miles.rollout.function import RolloutFunction
    from miles.settings.model import MilesSettings
    from miles.training.trainer import DistContext, Trainer
    from miles.transport.base import WeightTransport

__all__ = [
    "build_algorithm",
    "build_data_source",
    "build_loggers",
    "build_precision",
    "build_rollout_engine",
    "build_rollout_function",
    "build_trainer",
    "build_transport",
    "engine_dtype",
]


def build_precision(pm: PluginManager, settings: MilesSettings) -> PrecisionRecipe:
    return pm.create(ComponentKind.PRECISION, settings.precision, field="precision")


def engine_dtype(settings: MilesSettings, precision: PrecisionRecipe) -> str:
    """The dtype engines serve: ``rollout.engine_dtype``, or the precision recipe's parameter dtype."""
    return precision.param_dtype if settings.rollout.engine_dtype == "auto" else settings.rollout.engine_dtype


def build_trainer(pm: PluginManager, settings: MilesSettings, precision: PrecisionRecipe, dist: DistContext) -> Trainer:
    entry, options = pm.resolve(ComponentKind.TRAINER, settings.train.backend, field="train.backend")
    return entry.component(settings.train, options, precision, dist)


def build_algorithm(pm: PluginManager, settings: MilesSettings) -> Algorithm:
    return pm.create(ComponentKind.ALGORITHM, settings.algorithm, field="algorithm")


def build_transport(pm: PluginManager, settings: MilesSettings, precision: PrecisionRecipe) -> WeightTransport:
    return pm.create(
        ComponentKind.TRANSPORT,
        settings.transport,
        field="transport",
        run_dir=settings.log.run_dir,
        model_path=settings.train.model_path,
        engine_dtype=engine_dtype(settings, precision),
    )


def build_rollout_engine(pm: PluginManager, settings: MilesSettings) -> RolloutEngine:
    return pm.create(ComponentKind.ROLLOUT_ENGINE, settings.rollout.engine, field="rollout.engine")


def build_loggers(pm: PluginManager, settings: MilesSettings) -> list[MetricsLogger]:
    return [
        pm.create(ComponentKind.LOGGER, spec, field=f"log.loggers[{i}]", run_dir=settings.log.run_dir)
        for i, spec in enumerate(settings.log.loggers)
    ]


def build_data_source(
    pm: PluginManager, settings: MilesSettings, *, tokenizer: Any, path: str | None = None
) -> DataSource:
    """The prompt source with the tokenising pipeline (chat template applied once).

    :param path: read this file instead of ``data.path`` (an eval set).
    """
    from miles.data.factory import create_data_source

    data = settings.data if path is None else settings.data.model_copy(update={"path": path})
    return create_data_source(pm, data, tokenizer=tokenizer)


def build_rollout_function(pm: PluginManager, settings: MilesSettings) -> RolloutFunction | None:
    """``rollout.function``: a registered name or ``package.module:function``; ``None`` for the default."""
    ref = settings.rollout.function
    if ref is None:
        return None
    if ":" in ref:
        module_name, _, attr = ref.partition(":")
        try:
            module = importlib.import_module(module_name)
            function = getattr(module, attr)
        except (ImportError, AttributeError) as exc:
            raise SettingsError(f"rollout.function: cannot load {ref!r}: {type(exc).__name__}: {exc}") from None
        if not callable(function):
            raise SettingsError(f"rollout.function: {ref!r} is not callable")
        return function
    return pm.get(ComponentKind.ROLLOUT_FUNCTION, ref, field="rollout.function").component
