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

:class:`ComponentKind` is the table of the kinds of component: for each, the registry's name, the hook
that fills it, the settings field that selects it and the interface its components implement. A new
kind of component is one row here plus its hook specification in :mod:`miles.hookspecs`.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Generic, Protocol, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict

__all__ = [
    "Component",
    "ComponentKind",
    "ComponentSettings",
    "Register",
    "SettingsT",
    "component_settings_model",
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
        "miles.rollout.engine:RolloutEngine",
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

    def __init__(self, settings: SettingsT) -> None:
        self.settings = settings
