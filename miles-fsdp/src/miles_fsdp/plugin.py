"""The ``fsdp`` plugin: registers :class:`miles_fsdp.trainer.FSDPTrainer` as trainer ``fsdp``.

The trainer module imports only the core interfaces at module level (torch and transformers are imported
inside its methods), so listing plugins stays cheap.
"""

from __future__ import annotations

from miles.components import Register
from miles.markers import hookimpl


@hookimpl
def miles_register_trainers(register: Register) -> None:
    from miles_fsdp.trainer import FSDPTrainer

    register(FSDPTrainer)
