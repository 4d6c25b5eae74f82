"""The plugin module the ``calculator_agent`` entry point names.

It registers the rollout function ``calculator_agent`` (:class:`~miles.sessions.rollout.SessionRollout`
over :func:`~miles_calculator_agent.episode.calculator_episode`) and the reward ``calculator_answer``.
It imports no torch and no openai (the episode imports the client when it runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import miles
from miles.sessions.rollout import SessionRollout
from miles_calculator_agent.episode import calculator_episode
from miles_calculator_agent.reward import CalculatorAnswer

if TYPE_CHECKING:
    from miles.components import Register

CALCULATOR_AGENT = SessionRollout(
    calculator_episode, description="Arithmetic with a calculator tool, through the openai client (TITO sessions)."
)
"""The rollout function: one session (and one episode) per sample."""


@miles.hookimpl
def miles_register_rollout_functions(register: Register) -> None:
    """Register ``calculator_agent``."""
    register(CALCULATOR_AGENT, name="calculator_agent")


@miles.hookimpl
def miles_register_rewards(register: Register) -> None:
    """Register ``calculator_answer``."""
    register(CalculatorAnswer)
