"""miles-fsdp tests: make the spawned-job helper (``fsdp_job.py``) importable by the tests; the one-rank gloo
world the in-process trainer tests share (``world``, one per test module)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles.testing.fixtures import engines_may_load_test_weights  # noqa: F401  (autouse)

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="module")
def world() -> Iterator[Any]:
    """A one-rank gloo process group in this process, one thread, for the module's tests."""
    import torch

    from miles.net import free_port
    from miles_fsdp.distributed import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    ctx = init_distributed(0, 1, master_port=free_port())
    try:
        yield ctx
    finally:
        shutdown_distributed()
