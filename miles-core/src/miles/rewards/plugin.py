"""The built-in rewards plugin: ``math``, ``exact_match``, ``regex``, ``length_penalty``, ``remote``, ``model``
(reward models and judges), ``python_output`` (model-written code in the sandbox) and ``reasoning_gym`` (the
verifier of a reasoning-gym task)."""

from __future__ import annotations

from miles.components import Register
from miles.markers import hookimpl


@hookimpl
def miles_register_rewards(register: Register) -> None:
    from miles.rewards.code import PythonOutputReward
    from miles.rewards.model import ModelReward
    from miles.rewards.reasoning_gym import ReasoningGymReward
    from miles.rewards.remote import RemoteReward
    from miles.rewards.text import ExactMatchReward, LengthPenaltyReward, MathReward, RegexReward

    rewards = (MathReward, ExactMatchReward, RegexReward, LengthPenaltyReward, RemoteReward, ModelReward)
    for cls in (*rewards, PythonOutputReward, ReasoningGymReward):
        register(cls)
