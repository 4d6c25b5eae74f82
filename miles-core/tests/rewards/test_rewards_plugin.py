"""The built-in rewards plugin registers every reward and imports cheaply."""

from __future__ import annotations

import miles.rewards.plugin as plugin
from miles.testing.conformance import check_light_import, check_plugin


def test_plugin_registers_every_reward() -> None:
    check_plugin(
        plugin,
        name="rewards",
        expect=[
            ("reward", n)
            for n in ("math", "exact_match", "regex", "length_penalty", "remote", "model", "python_output")
        ],
    )


def test_plugin_module_imports_without_torch() -> None:
    check_light_import("miles.rewards.plugin", forbidden=("torch", "transformers", "httpx", "math_verify", "sympy"))
