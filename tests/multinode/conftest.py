"""The multi-node test bed: hosts as network namespaces, a Ray cluster across them, and the tiny model and
prompts of a run (all module-scoped)."""

from __future__ import annotations

from miles.testing.hosts import namespace_hosts  # noqa: F401  (fixture)
from miles.testing.ray_cluster import ray_cluster  # noqa: F401  (fixture)
from miles.testing.runs import arithmetic_prompts, tiny_model  # noqa: F401  (fixtures)
