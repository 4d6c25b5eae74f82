"""The plugin module the ``reward_example`` entry point names: it registers the ``keyword`` reward.

``miles plugins list`` imports every plugin module, so this one stays cheap: it imports only the reward
class, which itself needs nothing beyond the standard library and ``miles-core``'s interfaces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import miles
from miles_reward_example.keyword import KeywordReward

if TYPE_CHECKING:
    from miles.components import Register


@miles.hookimpl
def miles_register_rewards(register: Register) -> None:
    """Register the ``keyword`` reward."""
    register(KeywordReward)
