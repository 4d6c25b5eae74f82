"""The ``megatron`` plugin: registers :class:`miles_megatron.trainer.MegatronTrainer` as trainer ``megatron``.

The trainer module imports only the core interfaces and its settings at module level (torch, megatron
and mbridge are imported inside its methods), so listing plugins stays cheap.
"""

from __future__ import annotations

from miles import hookimpl
from miles.plugins.registry import Register


@hookimpl
def miles_register_trainers(register: Register) -> None:
    from miles_megatron.trainer import MegatronTrainer

    register(MegatronTrainer)
