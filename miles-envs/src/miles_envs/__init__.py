"""Miles connectors to the agent-environment libraries people already use.

Each library is an extra of ``miles-envs`` and a subpackage here, registered as a plugin of its own:
``miles_envs.verifiers`` (``[verifiers]``), ``miles_envs.openenv`` (OpenEnv servers, ``[openenv]``),
``miles_envs.text_games`` (textarena, ``[textarena]``), and ``miles_envs.gym_text`` (any Gymnasium-style text
environment, and the ``env_return`` reward; no extra). Importing this package imports none of them.
"""

from __future__ import annotations

__all__: list[str] = []
