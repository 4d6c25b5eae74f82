"""The component base: settings typed by the interface's parameter; the one table of kinds agrees with the
hook specifications and the settings."""

from __future__ import annotations

import importlib
import inspect

import pytest
from pydantic import Field

from miles import hookspecs
from miles.components import Component, ComponentKind, ComponentSettings
from miles.rewards.base import Reward
from miles.settings.model import MilesSettings
from miles.types import Sample


class Loud(ComponentSettings):
    """Settings of the test reward."""

    volume: int = Field(3, ge=1)
    """How loud."""


class Louder(Loud):
    """A refinement of the settings."""


class Other(ComponentSettings):
    """Unrelated settings."""


def test_settings_come_from_the_interface_parameter() -> None:
    class Shout(Reward[Loud]):
        """A reward parametrised with its settings."""

        name = "shout"

        async def score(self, sample: Sample) -> float:
            return float(self.settings.volume)

    assert Shout.Settings is Loud
    assert Shout(Loud(volume=5)).settings.volume == 5

    class Refined(Reward[Loud]):
        """A reward that names a subclass of its parameter explicitly."""

        name = "refined"
        Settings = Louder

        async def score(self, sample: Sample) -> float:
            return 0.0

    assert Refined.Settings is Louder
    with pytest.raises(TypeError, match=r"Settings must be that model or a subclass of it"):

        class Wrong(Reward[Loud]):  # pyright: ignore
            """Declares settings unrelated to its parameter."""

            name = "wrong"
            Settings = Other

            async def score(self, sample: Sample) -> float:
                return 0.0


def test_every_kind_has_its_hook_its_field_and_its_interface() -> None:
    registration_specs = {n for n in dir(hookspecs) if n.startswith("miles_register_")} - {"miles_register_commands"}
    assert {kind.hook for kind in ComponentKind} == registration_specs
    for kind in ComponentKind:
        assert ComponentKind(kind.value) is kind and ComponentKind.of_hook(kind.hook) is kind
        value: object = MilesSettings()
        for part in kind.field.split("."):
            value = getattr(value, part)  # the selecting field exists in the settings tree
        assert isinstance(value, list) == kind.many, kind
        if kind.interface:
            module, _, attr = kind.interface.partition(":")
            interface = getattr(importlib.import_module(module), attr)
            assert inspect.isclass(interface) and issubclass(interface, Component), kind
    assert ComponentKind.of_hook("miles_on_step_end") is None
