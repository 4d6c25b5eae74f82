"""Fixtures of the launcher tests."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def script(tmp_path: Path) -> Callable[[str, str], list[str]]:
    """``script(name, source)`` writes a Python file and returns the argv that runs it."""

    def make(name: str, source: str) -> list[str]:
        path = tmp_path / f"{name}.py"
        path.write_text(source, encoding="utf-8")
        return [sys.executable, str(path)]

    return make
