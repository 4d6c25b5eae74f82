"""The ``verifiers`` plugin: verifiers environments as a data source, a rollout function and a reward, each
named ``verifiers``. It imports neither verifiers nor openai (the components import them when they run)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import miles

if TYPE_CHECKING:
    from miles.components import Register


@miles.hookimpl
def miles_register_data_sources(register: Register) -> None:
    """Register the data source ``verifiers``."""
    from miles_envs.verifiers.data import VerifiersDataSource

    register(VerifiersDataSource)


@miles.hookimpl
def miles_register_rollout_functions(register: Register) -> None:
    """Register the rollout function ``verifiers``."""
    from miles_envs.verifiers.rollout import VERIFIERS_ROLLOUT

    register(VERIFIERS_ROLLOUT, name="verifiers")


@miles.hookimpl
def miles_register_rewards(register: Register) -> None:
    """Register the reward ``verifiers``."""
    from miles_envs.verifiers.reward import VerifiersReward

    register(VerifiersReward)
