"""The ``megatron`` plugin: registers :class:`miles_megatron.trainer.MegatronTrainer` as trainer ``megatron``
and adds ``miles convert hf-to-megatron`` / ``miles convert megatron-to-hf`` to the core's ``convert`` group.

The trainer and conversion modules import only the core interfaces, their settings and typer at module
level (torch, megatron and mbridge are imported inside their functions), so listing plugins stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles import hookimpl
from miles.plugins.registry import Register

if TYPE_CHECKING:
    import typer


@hookimpl
def miles_register_trainers(register: Register) -> None:
    from miles_megatron.trainer import MegatronTrainer

    register(MegatronTrainer)


@hookimpl
def miles_register_commands(app: typer.Typer) -> None:
    from miles_megatron.convert import register_commands

    register_commands(app)
