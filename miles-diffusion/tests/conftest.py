"""miles-diffusion tests: a tiny policy per session; the spawned trainer job (``trainer_job.py``) importable."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD3-style pipeline directory, built once per session."""
    from miles_diffusion.policy import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", seed=0)


@pytest.fixture(scope="session")
def pipe(policy_dir: Path) -> Any:
    from miles_diffusion.policy import load_pipeline

    return load_pipeline(policy_dir)
