"""Fixtures of the miles-envs tests: the test environments' folder, and rollout functions resolved with the package's plugins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ENVS = Path(__file__).resolve().parent / "verifiers_envs"


@pytest.fixture
def envs_dir() -> Path:
    """The folder of the test's verifiers environment modules (``two_turn_sums.py`` ...)."""
    return ENVS


ENVS_PLUGINS = (
    ("gym_text", "miles_envs.gym_text.plugin"),
    ("openenv", "miles_envs.openenv.plugin"),
    ("text_games", "miles_envs.text_games.plugin"),
)
"""miles-envs' plugins of the rollout functions, registered as built-ins (no entry-point loading in tests)."""


def resolve_function(function: dict[str, Any]) -> Any:
    """The run of ``rollout.function = function`` resolved with miles-envs' plugins (its settings validated)."""
    from miles.components import ComponentKind
    from miles.compose import build_run
    from miles.plugins.builtin import BUILTIN_PLUGINS
    from miles.plugins.manager import PluginManager
    from miles.settings.model import MilesSettings

    pm = PluginManager(builtins=(*BUILTIN_PLUGINS, *ENVS_PLUGINS), entry_points=False)
    settings = MilesSettings.model_validate({"rollout": {"function": function}})
    return build_run(settings, pm.load(), kinds=(ComponentKind.ROLLOUT_FUNCTION,))
