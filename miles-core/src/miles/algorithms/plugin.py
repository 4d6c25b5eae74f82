"""The built-in algorithms plugin: registers every RL objective that ships with miles-core.

Importing this module is cheap (no torch): the algorithm modules import torch inside their functions.
"""

from __future__ import annotations

from miles.plugins.manager import hookimpl
from miles.plugins.registry import Register


@hookimpl
def miles_register_algorithms(register: Register) -> None:
    from miles.algorithms.group import DAPO, GRPO, GSPO, RLOO, DrGRPO
    from miles.algorithms.ppo import PPO
    from miles.algorithms.reinforce import ReinforcePP, ReinforcePPBaseline
    from miles.algorithms.supervised import SFT, Distill

    for cls in (GRPO, DrGRPO, DAPO, GSPO, RLOO, ReinforcePP, ReinforcePPBaseline, PPO, SFT, Distill):
        register(cls)
