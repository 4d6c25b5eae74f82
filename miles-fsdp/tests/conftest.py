"""miles-fsdp tests: make the spawned-job helper (``fsdp_job.py``) importable by the tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(autouse=True, scope="session")
def _engines_may_load_test_weights(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Engines started by these tests may load weights from the session's temp directories (an engine loads
    only from its model's directory and the allowed ones: :mod:`miles.engine.weight_paths`)."""
    before = os.environ.get("MILES_ALLOWED_WEIGHT_DIRS")
    os.environ["MILES_ALLOWED_WEIGHT_DIRS"] = str(tmp_path_factory.getbasetemp())
    yield
    if before is None:
        os.environ.pop("MILES_ALLOWED_WEIGHT_DIRS", None)
    else:
        os.environ["MILES_ALLOWED_WEIGHT_DIRS"] = before
