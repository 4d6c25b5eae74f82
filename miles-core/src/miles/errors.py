"""Errors Miles raises on purpose. Each carries a message that names the field, file or plugin."""

from __future__ import annotations

__all__ = [
    "DataError",
    "DuplicateComponentError",
    "EngineError",
    "LaunchError",
    "MilesError",
    "MissingExtraError",
    "NonFiniteStepError",
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


class MissingExtraError(SettingsError):
    """A selected component needs a package that is not installed: names the component, its field and the
    extra that installs the package (``pip install "miles-core[wandb]"``)."""


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


class DataError(MilesError):
    """A bad data row or file: names the file and line (``prompts.jsonl:17: missing key 'prompt'``)."""

    exit_code = 2


class LaunchError(MilesError):
    """A process the launcher started failed to come up or exited with an error.

    The message names the process (``trainer-1``, ``engine-0``), its exit code and the tail of its log.
    """

    def __init__(
        self, message: str, *, process: str | None = None, returncode: int | None = None, log_tail: str = ""
    ) -> None:
        super().__init__(message)
        self.process = process
        """Name of the failed process (``trainer-1``), when one is to blame."""
        self.returncode = returncode
        """Its exit code (negative: killed by that signal), when it exited."""
        self.log_tail = log_tail
        """The last lines of its log file."""


class NonFiniteStepError(MilesError):
    """A training step's loss or gradient norm is NaN or infinite: the optimizer step was refused, so the
    weights (and what the engines serve) stay those of the step before. Names the step and the value."""
