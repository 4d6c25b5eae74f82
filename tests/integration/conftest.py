"""Fixtures of the integration suites: a tiny model and arithmetic prompts, from the test kit."""

from pathlib import Path

import pytest

from miles.testing.runs import arithmetic_prompts, tiny_model  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def prompts(arithmetic_prompts: Path) -> Path:  # noqa: F811
    """The suites' name for :func:`miles.testing.runs.arithmetic_prompts`."""
    return arithmetic_prompts
