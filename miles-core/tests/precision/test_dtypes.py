"""Floating-point dtypes by name."""

from __future__ import annotations

import pytest
import torch

from miles.errors import SettingsError
from miles.precision.dtypes import torch_dtype


def test_torch_dtype_rejects_non_float_names() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(SettingsError, match="precision: 'int8'"):
        torch_dtype("int8")


def test_torch_dtype_names_the_field_it_was_given() -> None:
    with pytest.raises(SettingsError, match="^rollout.engine.dtype: 'int8'"):
        torch_dtype("int8", field="rollout.engine.dtype")
    with pytest.raises(SettingsError, match="^'nope' is not"):
        torch_dtype("nope", field=None)
