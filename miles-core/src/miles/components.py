"""What every pluggable component shares, and the one table of the kinds of component.

A component is a class (or a factory) with a ``name`` it is registered under and a settings model. The
settings file selects a component by name and passes its other keys to that model; the model validates
them, and its field docstrings are the component's reference documentation.

Component classes derive from their kind's interface parametrised by their settings model, and receive
an instance of exactly that model::

    class LocalEngine(RolloutEngine[LocalEngineSettings]):
        name = "local"

        def launch(self, ...):
            self.settings.max_cache_tokens     # typed: LocalEngineSettings

``Settings`` is derived from the parameter (it may also be set explicitly, to a subclass of it).

A component that imports a package beyond miles-core's own dependencies declares it in ``requires`` (a
:class:`Requirement`: the import name and the extra that installs it); the composition root checks every
selected component's before anything starts and names the extra of each that is missing::

    class WandbLogger(MetricsLogger[WandbSettings]):
        name = "wandb"
        requires = (Requirement("wandb", extra="wandb"),)

:class:`ComponentKind` is the table of the kinds of component: for each, the registry's name, the hook
that fills it, the settings field that selects it and the interface its components implement. A new
kind of component is one row here plus its hook specification in :mod:`miles.hookspecs`.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, Generic, Protocol, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict

from miles.errors import MissingExtraError

__all__ = [
    "Component",
    "ComponentKind",
    "ComponentSettings",
    "Register",
    "Requirement",
    "SettingsT",
    "component_settings_model",
    "missing_requirements",
]


class ComponentSettings(BaseModel):
    """Base of every component's settings model: unknown keys are errors, field docstrings are help."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


SettingsT = TypeVar("SettingsT", bound=BaseModel)
"""The settings model a component class is parametrised with."""


class Register(Protocol):
    """The callback a registration hook receives: ``register(MyTrainer)`` or ``register(obj, name="x")``."""

    def __call__(self, component: Any, *, name: str | None = None) -> None: ...


class ComponentKind(str, enum.Enum):
    """The kinds of component, one row each: ``(registry, registration hook, selecting field, interface)``.

    The value is the registry's name (``ComponentKind("trainer")``). ``field`` is the settings path that
    selects components of this kind; ``many`` marks a list of selections (``reward.functions``);
    ``interface`` is ``module:Class`` of the base class its components derive from (empty for plain
    callables).
    """

    hook: str
    field: str
    interface: str
    many: bool

    def __new__(
        cls, value: str, hook: str = "", field: str = "", interface: str = "", many: bool = False
    ) -> ComponentKind:
        member = str.__new__(cls, value)
        member._value_ = value
        member.hook = hook
        member.field = field
        member.interface = interface
        member.many = many
        return member

    LAUNCHER = ("launcher", "miles_register_launchers", "cluster.launcher", "miles.launch.base:Launcher")
    DATA_SOURCE = ("data_source", "miles_register_data_sources", "data.source", "miles.data.base:DataSource")
    ROLLOUT_ENGINE = (
        "rollout_engine",
        "miles_register_rollout_engines",
        "rollout.engine",
        "miles.rollout.backend:RolloutEngine",
    )
    ROLLOUT_FUNCTION = ("rollout_function", "miles_register_rollout_functions", "rollout.function", "")
    TRAINER = ("trainer", "miles_register_trainers", "train.backend", "miles.training.trainer:Trainer")
    ADAPTER = ("adapter", "miles_register_adapters", "train.adapter", "miles.training.adapter:ModelAdapter")
    ALGORITHM = ("algorithm", "miles_register_algorithms", "algorithm", "miles.algorithms.base:Algorithm")
    TRANSPORT = ("transport", "miles_register_transports", "transport", "miles.transport.base:WeightTransport")
    PRECISION = ("precision", "miles_register_precisions", "precision", "miles.precision.base:PrecisionRecipe")
    REWARD = ("reward", "miles_register_rewards", "reward.functions", "miles.rewards.base:Reward", True)
    LOGGER = ("logger", "miles_register_loggers", "log.loggers", "miles.metrics.base:MetricsLogger", True)

    @property
    def label(self) -> str:
        """Human name used in messages: ``rollout engine``, ``trainer`` ..."""
        return self.value.replace("_", " ")

    @classmethod
    def of_hook(cls, hook: str) -> ComponentKind | None:
        """The kind a registration hook fills (``None`` for any other hook)."""
        return next((kind for kind in cls if kind.hook == hook), None)


@dataclass(frozen=True)
class Requirement:
    """A package a component imports beyond miles-core's own dependencies, and the extra that installs it.

    ``Requirement("math_verify", extra="math", package="math-verify")`` reads: the component imports
    ``math_verify``, which ``pip install "miles-core[math]"`` installs.
    """

    module: str
    """The top-level import name (located, not imported, when checked)."""
    extra: str
    """The extra of :attr:`distribution` that installs it."""
    distribution: str = "miles-core"
    """The distribution whose extra it is."""
    package: str = ""
    """The package's name when it differs from :attr:`module` (``math-verify``)."""

    @property
    def install(self) -> str:
        """The install line: ``pip install "miles-core[math]"``."""
        return f'pip install "{self.distribution}[{self.extra}]"'

    def installed(self) -> bool:
        """Whether :attr:`module` is there to import (found without importing it: checking costs nothing)."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False

    def missing_error(self, what: str) -> MissingExtraError:
        """The error for ``what`` (``"precision: precision 'fp8'"``) needing the package, which is missing."""
        return MissingExtraError(f"{what} needs {self.package or self.module}, which is not installed: {self.install}")

    def load(self, what: str, module: str | None = None) -> ModuleType:
        """Import ``module`` (default :attr:`module`; a module that imports the package, say), or raise
        :meth:`missing_error` for ``what`` (with the import's own error when the package is there)."""
        try:
            return importlib.import_module(module or self.module)
        except ImportError as exc:
            if not self.installed():
                raise self.missing_error(what) from None
            raise MissingExtraError(f"{what} cannot import {module or self.module}: {exc} ({self.install})") from exc


def missing_requirements(component: Any, options: BaseModel) -> list[Requirement]:
    """The requirements of a registered component with its settings ``options`` that are not installed (a
    class's :meth:`Component.requirements`; a plain factory declares none)."""
    requirements = getattr(component, "requirements", None)  # a registered factory need not be a Component
    return [r for r in (requirements(options) if requirements is not None else ()) if not r.installed()]


def component_settings_model(component: Any) -> type[BaseModel]:
    """The settings model of a registered component (``ComponentSettings`` when it declares none)."""
    model = getattr(component, "Settings", None)
    if model is None:
        return ComponentSettings
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"{component!r}.Settings must be a pydantic BaseModel subclass, got {model!r}")
    return model


def _settings_parameter(cls: type) -> type[BaseModel] | None:
    """The concrete settings model ``cls`` itself parametrises a component base with (``Base[XSettings]``)."""
    for base in cls.__dict__.get("__orig_bases__", ()):
        origin = get_origin(base)
        if isinstance(origin, type) and issubclass(origin, Component):
            for arg in get_args(base):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    return arg
    return None


class Component(Generic[SettingsT]):
    """Base of every component interface: a ``name``, a ``Settings`` model and typed ``settings``.

    A subclass parametrised with a concrete model (``Reward[MySettings]``) gets it as ``Settings``; a
    ``Settings`` set explicitly must be that model or a subclass of it.
    """

    name: ClassVar[str] = ""
    Settings: ClassVar[type[BaseModel]] = ComponentSettings
    requires: ClassVar[tuple[Requirement, ...]] = ()
    """Packages beyond miles-core's dependencies that this component imports: the composition root refuses
    a run that selects it while one is missing, naming its extra, before anything starts."""
    settings: SettingsT

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = _settings_parameter(cls)
        if declared is None:
            return
        if "Settings" not in cls.__dict__:
            cls.Settings = declared
        elif not (isinstance(cls.Settings, type) and issubclass(cls.Settings, declared)):
            raise TypeError(
                f"{cls.__qualname__}.Settings is {cls.Settings!r}, but the class is parametrised with "
                f"{declared.__qualname__}: Settings must be that model or a subclass of it"
            )

    @classmethod
    def requirements(cls, options: Any) -> tuple[Requirement, ...]:
        """What this component imports with its settings ``options``: :attr:`requires`, and more where a
        setting selects what is imported (a data path, a library)."""
        return cls.requires

    def __init__(self, settings: SettingsT) -> None:
        self.settings = settings
