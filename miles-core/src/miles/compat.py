"""Modules that moved out of miles-core, importable under their old names for one release.

A moved module's old file is a stub whose ``__getattr__`` is :func:`moved_module`: a name taken from it is
the new module's, with a :class:`DeprecationWarning` naming the new place (or an ``ImportError`` naming the
distribution to install when the new module is not installed). Nothing here imports a backend package
until such a name is asked for.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["moved_module"]


def moved_module(old: str, new: str, *, distribution: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` of the stub left at ``old`` for the module now at ``new`` (in
    ``distribution``)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # import machinery probing the stub (__path__, __wrapped__ ...)
            raise AttributeError(name)
        try:
            module = importlib.import_module(new)
        except ImportError:
            raise ImportError(f"{old} moved to {new}: pip install {distribution}") from None
        warnings.warn(
            f"{old} moved to {new} (in {distribution}); import it from there: the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(module, name)

    return __getattr__
