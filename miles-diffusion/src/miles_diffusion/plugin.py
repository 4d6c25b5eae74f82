"""The ``diffusion`` plugin: the image engine, the trainer, Flow-GRPO, the image rewards and the rollout
function, each registered under the name its settings select.

Imports cheaply: no torch or diffusers until a component is built.
"""

from __future__ import annotations

from miles.components import Register
from miles.markers import hookimpl


@hookimpl
def miles_register_rollout_engines(register: Register) -> None:
    from miles_diffusion.engine.backend import ImageEngine

    register(ImageEngine)


@hookimpl
def miles_register_rollout_functions(register: Register) -> None:
    from miles_diffusion.rollout import diffusion_rollout

    register(diffusion_rollout, name="diffusion")


@hookimpl
def miles_register_trainers(register: Register) -> None:
    from miles_diffusion.trainer.trainer import DiffusionTrainer

    register(DiffusionTrainer)


@hookimpl
def miles_register_algorithms(register: Register) -> None:
    from miles_diffusion.algorithm import FlowGRPO

    register(FlowGRPO)


@hookimpl
def miles_register_rewards(register: Register) -> None:
    from miles_diffusion.rewards import REWARDS

    for reward in REWARDS:
        register(reward)
