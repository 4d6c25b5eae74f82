"""The learning-rate schedule every trainer follows."""

from __future__ import annotations

import pytest

from miles.errors import SettingsError
from miles.training.lr_schedule import lr_factor


def test_warmup_then_cosine_to_min_lr() -> None:
    kw = dict(warmup_steps=4, total_steps=14, schedule="cosine", lr=1e-5, min_lr=1e-6)
    assert [lr_factor(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]  # type: ignore[arg-type]
    assert lr_factor(4, **kw) == 1.0  # type: ignore[arg-type]
    assert lr_factor(9, **kw) == pytest.approx(0.1 + 0.9 * 0.5)  # type: ignore[arg-type]
    assert lr_factor(14, **kw) == pytest.approx(0.1)  # type: ignore[arg-type]
    assert lr_factor(99, **kw) == pytest.approx(0.1)  # type: ignore[arg-type]


def test_linear_and_constant_schedules() -> None:
    assert lr_factor(5, warmup_steps=0, total_steps=10, schedule="linear", lr=1.0, min_lr=0.0) == pytest.approx(0.5)
    assert lr_factor(7, warmup_steps=2, total_steps=10, schedule="constant", lr=1.0, min_lr=0.0) == 1.0
    with pytest.raises(SettingsError, match="train.lr_schedule"):
        lr_factor(3, warmup_steps=0, total_steps=10, schedule="step", lr=1.0, min_lr=0.0)
