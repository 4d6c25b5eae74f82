"""Shared fixtures of the data tests: the tiny tokenizer saved and reloaded the way a run loads it."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from miles.testing.models import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))
