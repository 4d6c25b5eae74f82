"""What every pluggable component shares: a name it is registered under and a settings model.

A component is a class (or a factory) with a ``name`` and, optionally, a ``Settings`` model. The settings
file selects a component by name and passes its remaining keys to ``Settings``; that model validates them
and its field docstrings are the component's reference documentation.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

__all__ = ["ComponentKind", "ComponentSettings", "component_settings_model"]


class ComponentSettings(BaseModel):
    """Base of every component's settings model: unknown keys are errors, field docstrings are help."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class ComponentKind(str, enum.Enum):
    """The typed registries, one per kind of component (the value is the registry's name)."""

    ROLLOUT_ENGINE = "rollout_engine"
    ROLLOUT_FUNCTION = "rollout_function"
    TRAINER = "trainer"
    TRANSPORT = "transport"
    PRECISION = "precision"
    ALGORITHM = "algorithm"
    REWARD = "reward"
    DATA_SOURCE = "data_source"
    LAUNCHER = "launcher"
    LOGGER = "logger"

    @property
    def label(self) -> str:
        """Human name used in messages: ``rollout engine``, ``trainer`` ..."""
        return self.value.replace("_", " ")


def component_settings_model(component: Any) -> type[BaseModel]:
    """The settings model of a registered component (``ComponentSettings`` when it declares none)."""
    model = getattr(component, "Settings", None)
    if model is None:
        return ComponentSettings
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"{component!r}.Settings must be a pydantic BaseModel subclass, got {model!r}")
    return model


class NamedComponent:
    """Optional mixin for component classes: declares ``name`` and an empty ``Settings``."""

    name: ClassVar[str] = ""
    Settings: ClassVar[type[BaseModel]] = ComponentSettings
