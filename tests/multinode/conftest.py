"""The multi-node test bed: hosts as network namespaces (module-scoped)."""

from __future__ import annotations

from miles.testing.hosts import namespace_hosts  # noqa: F401  (fixture)
