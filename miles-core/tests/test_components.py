"""The component base: settings typed by the interface's parameter; the one table of kinds agrees with the
hook specifications and the settings; what a component imports beyond miles-core's dependencies is declared,
with the extra that installs it."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
import sys

import pytest
from pydantic import Field

from miles import hookspecs
from miles.components import Component, ComponentKind, ComponentSettings, Requirement, missing_requirements
from miles.errors import MissingExtraError, SettingsError
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


def test_a_requirement_names_its_extra_and_is_found_without_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    present = Requirement("json", extra="json")
    assert present.installed() and present.load("the test").dumps([1]) == "[1]"
    assert present.install == 'pip install "miles-core[json]"'
    absent = Requirement("no_such_module_xyz", extra="xyz", distribution="miles-p2p", package="xyz-lib")
    assert not absent.installed()
    with pytest.raises(
        MissingExtraError, match=r'^the test needs xyz-lib, which is not installed: pip install "miles-p2p\[xyz\]"$'
    ):
        absent.load("the test")
    assert issubclass(MissingExtraError, SettingsError)  # exit code 2, no traceback
    monkeypatch.setitem(sys.modules, "json", None)  # as if not installed: neither found nor imported
    assert not present.installed()


def test_the_composition_root_asks_a_component_for_its_requirements_with_its_settings() -> None:
    wanted = Requirement("no_such_module_xyz", extra="xyz")

    class Picky(Reward[Loud]):
        name = "picky"
        requires = (Requirement("json", extra="json"),)

        @classmethod
        def requirements(cls, options: Loud) -> tuple[Requirement, ...]:
            return (*cls.requires, wanted) if options.volume > 3 else cls.requires

        async def score(self, sample: Sample) -> float:
            return 0.0

    assert missing_requirements(Picky, Loud()) == []
    assert missing_requirements(Picky, Loud(volume=4)) == [wanted]
    assert missing_requirements(lambda options: None, Loud()) == []  # a plain factory declares none


def test_built_in_components_declare_the_extras_of_miles_core() -> None:
    from miles.data.sources import HFDataSource, ParquetDataSource
    from miles.launch.ray_launcher import RayLauncher
    from miles.metrics.tensorboard import TensorBoardLogger
    from miles.metrics.wandb import WandbLogger
    from miles.precision.quantized import FP8, MXFP8, NVFP4
    from miles.rewards.text import MathReward
    from miles.transport.disk_delta import DiskDeltaTransport

    declared = {
        cls.name: {(r.module, r.extra) for r in cls.requires}
        for cls in (
            HFDataSource,
            ParquetDataSource,
            RayLauncher,
            TensorBoardLogger,
            WandbLogger,
            FP8,
            MXFP8,
            NVFP4,
            MathReward,
            DiskDeltaTransport,
        )
    }
    assert declared == {
        "hf": {("datasets", "hf")},
        "parquet": {("pyarrow", "parquet")},
        "ray": {("ray", "ray")},
        "tensorboard": {("tensorboard", "tensorboard")},
        "wandb": {("wandb", "wandb")},
        "fp8": {("torchao", "quant")},
        "mxfp8": {("torchao", "quant")},
        "nvfp4": {("torchao", "quant")},
        "math": {("math_verify", "math")},
        "disk_delta": {("zstandard", "delta")},
    }
    extras = set(importlib.metadata.metadata("miles-core").get_all("Provides-Extra") or [])
    assert {extra for needs in declared.values() for _, extra in needs} | {"plot", "gguf"} <= extras


def test_miles_core_has_at_most_16_hard_dependencies() -> None:
    hard = [r for r in importlib.metadata.requires("miles-core") or [] if "extra ==" not in r]
    names = {re.split(r"[<>=!~;\s\[]", r)[0] for r in hard}
    assert len(hard) <= 16, hard
    assert not {"tensorboard", "wandb", "matplotlib", "math-verify", "sympy", "pyarrow", "zstandard"} & names
