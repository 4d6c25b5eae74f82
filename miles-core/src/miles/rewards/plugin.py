"""The built-in rewards plugin: ``math``, ``exact_match``, ``regex``, ``length_penalty`` and ``remote``."""

from __future__ import annotations

from miles.components import Register
from miles.markers import hookimpl


@hookimpl
def miles_register_rewards(register: Register) -> None:
    from miles.rewards.remote import RemoteReward
    from miles.rewards.text import ExactMatchReward, LengthPenaltyReward, MathReward, RegexReward

    for cls in (MathReward, ExactMatchReward, RegexReward, LengthPenaltyReward, RemoteReward):
        register(cls)
