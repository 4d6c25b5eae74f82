"""Fixtures of the integration suites: a tiny model and arithmetic prompts, from the test kit."""

from miles.testing.runs import arithmetic_prompts, tiny_model  # noqa: F401  (fixtures)
