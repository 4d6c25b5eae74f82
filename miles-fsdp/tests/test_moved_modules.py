"""The FSDP-only modules that left miles-core are importable under their old names for one release."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("fused_logprobs", "fused_token_logprobs"),
        ("onednn_linear", "install_onednn_linears"),
        ("packed_attention", "register_packed_attention"),
    ],
)
def test_the_old_name_gives_the_moved_module_with_a_warning(module: str, name: str) -> None:
    old = importlib.import_module(f"miles.training.{module}")
    with pytest.warns(DeprecationWarning, match=f"miles.training.{module} moved to miles_fsdp.{module}"):
        value = getattr(old, name)
    assert value is getattr(importlib.import_module(f"miles_fsdp.{module}"), name)
