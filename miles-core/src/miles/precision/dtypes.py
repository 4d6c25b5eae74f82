"""Floating-point dtypes by name, as the settings spell them (``"bfloat16"``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.errors import SettingsError

if TYPE_CHECKING:
    import torch

__all__ = ["torch_dtype"]


def torch_dtype(name: str, *, field: str | None = "precision") -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a :class:`~miles.errors.SettingsError` naming ``field`` (the setting that gave the
    name) for anything that is not a floating-point torch dtype."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        where = f"{field}: " if field else ""
        raise SettingsError(f"{where}{name!r} is not a floating-point torch dtype")
    return dtype
