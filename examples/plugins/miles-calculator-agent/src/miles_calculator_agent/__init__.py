"""An example agent environment for Miles: arithmetic questions, a calculator tool, the openai client.

The episode (:func:`~miles_calculator_agent.episode.calculator_episode`) is an ordinary OpenAI tool-use
loop; Miles' session server records its exact tokens. The plugin registers it as the rollout function
``calculator_agent`` (a GRPO group of episodes per prompt) and the reward ``calculator_answer``.
"""

from __future__ import annotations

from miles_calculator_agent.calculator import CALCULATOR_TOOL, calculate
from miles_calculator_agent.episode import calculator_episode, final_answer
from miles_calculator_agent.reward import CalculatorAnswer

__all__ = ["CALCULATOR_TOOL", "CalculatorAnswer", "calculate", "calculator_episode", "final_answer"]
