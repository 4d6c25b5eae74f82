"""The ``sglang`` plugin: rollout engine ``sglang`` (SGLang servers) and transport ``sglang_tensor`` (CUDA IPC
to a colocated engine). Cheap to import: neither torch nor SGLang is loaded to list the plugin."""

from __future__ import annotations

from miles.components import Register
from miles.markers import hookimpl


@hookimpl
def miles_register_rollout_engines(register: Register) -> None:
    from miles_sglang.engine import SGLangEngine

    register(SGLangEngine)


@hookimpl
def miles_register_transports(register: Register) -> None:
    from miles_sglang.tensor_transport import TensorTransport

    register(TensorTransport)
