"""Errors Miles raises on purpose. Each carries a message that names the field, file or plugin."""

from __future__ import annotations

__all__ = [
    "DuplicateComponentError",
    "EngineError",
    "MilesError",
    "PluginLoadError",
    "SettingsError",
    "UnknownComponentError",
    "WeightVerificationError",
]


class MilesError(Exception):
    """Base class. The CLI prints the message (no traceback) and exits with :attr:`exit_code`."""

    exit_code = 1


class SettingsError(MilesError):
    """A configuration mistake: names the field path and where the value came from."""

    exit_code = 2


class DuplicateComponentError(MilesError):
    """Two plugins registered the same name in one registry."""


class UnknownComponentError(SettingsError):
    """Settings select a component no loaded plugin registered."""


class PluginLoadError(MilesError):
    """A plugin the run needs failed to load (the message holds its error and traceback)."""

    exit_code = 2


class EngineError(MilesError):
    """An engine answered with an error (HTTP >= 400) or could not be reached."""


class WeightVerificationError(MilesError):
    """After a weight push, the engines do not serve what the trainer sent (names the tensor)."""
