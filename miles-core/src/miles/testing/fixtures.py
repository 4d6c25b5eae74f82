"""pytest fixtures for test suites that start engines (import them into a ``conftest.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

__all__ = ["engines_may_load_test_weights"]


@pytest.fixture(autouse=True, scope="session")
def engines_may_load_test_weights(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Engines started by the session's tests may load weights from its temp directories: a local engine
    loads only from its model's directory and the allowed ones (:mod:`miles.engine.weight_paths`), here
    ``MILES_ALLOWED_WEIGHT_DIRS``, which engine processes inherit."""
    before = os.environ.get("MILES_ALLOWED_WEIGHT_DIRS")
    os.environ["MILES_ALLOWED_WEIGHT_DIRS"] = str(tmp_path_factory.getbasetemp())
    yield
    if before is None:
        os.environ.pop("MILES_ALLOWED_WEIGHT_DIRS", None)
    else:
        os.environ["MILES_ALLOWED_WEIGHT_DIRS"] = before
