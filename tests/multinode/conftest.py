"""The multi-node test bed: hosts as network namespaces, and a Ray cluster across them (module-scoped)."""

from __future__ import annotations

from miles.testing.hosts import namespace_hosts  # noqa: F401  (fixture)
from miles.testing.ray_cluster import ray_cluster  # noqa: F401  (fixture)
