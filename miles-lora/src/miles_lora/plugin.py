"""The ``lora`` plugin: registers :class:`miles_lora.adapter.LoraAdapter` as adapter ``lora`` and
:class:`miles_lora.transport.LoraTransport` as transport ``lora``.

Both modules import only the core interfaces and pydantic at module level (torch and peft are imported
where they are used), so listing plugins stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import miles

if TYPE_CHECKING:
    from miles.components import Register


@miles.hookimpl
def miles_register_adapters(register: Register) -> None:
    from miles_lora.adapter import LoraAdapter

    register(LoraAdapter)


@miles.hookimpl
def miles_register_transports(register: Register) -> None:
    from miles_lora.transport import LoraTransport

    register(LoraTransport)
