"""Fixtures of the miles-envs tests: the test environments' folder."""

from __future__ import annotations

from pathlib import Path

import pytest

ENVS = Path(__file__).resolve().parent / "verifiers_envs"


@pytest.fixture
def envs_dir() -> Path:
    """The folder of the test's verifiers environment modules (``two_turn_sums.py`` ...)."""
    return ENVS
