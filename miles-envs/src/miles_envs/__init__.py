"""Miles connectors to the agent-environment libraries people already use.

Each library is an extra of ``miles-envs`` and a subpackage here (``miles_envs.verifiers``), registered as a
plugin of its own; importing this package imports none of them.
"""

from __future__ import annotations

__all__: list[str] = []
