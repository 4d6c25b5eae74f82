from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD3-style pipeline directory, built once per session."""
    from miles_diffusion.policy import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", seed=0)


@pytest.fixture(scope="session")
def pipe(policy_dir: Path) -> Any:
    from miles_diffusion.policy import load_pipeline

    return load_pipeline(policy_dir)
