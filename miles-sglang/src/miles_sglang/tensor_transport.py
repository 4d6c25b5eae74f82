"""The ``sglang_tensor`` transport: colocated SGLang engines read the trainer's GPU tensors in place, through
CUDA IPC and SGLang's ``/update_weights_from_tensor`` — Miles' ``tensor_ipc`` transport
(:mod:`miles.transport.colocated`: any number of engines, any TP size, each engine TP rank fed by the
trainer rank on its GPU) with the handles made by SGLang's own serializer.

SGLang's ``MultiprocessingSerializer`` (imported from SGLang, its own format) with its patched reductions
names each tensor's GPU by UUID and rebuilds it with a function its receiving ``SafeUnpickler`` allows (Miles'
own payload is JSON, which SGLang does not read). On a CPU the handles are PyTorch's shared-memory files. No tensor data crosses HTTP, and
Miles never deserialises anything here. Needs SGLang installed where the trainer runs (the colocated host
has it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

from miles.errors import SettingsError
from miles.transport.colocated import TensorIpcTransport, tensor_payload
from miles_sglang.settings import TensorTransportSettings

if TYPE_CHECKING:
    import torch

    from miles.settings.model import MilesSettings

__all__ = ["TENSOR_REQUEST_FIELDS", "TensorTransport", "tensor_payload"]

log = logging.getLogger(__name__)

TENSOR_REQUEST_FIELDS = ("serialized_named_tensors", "load_format", "flush_cache", "weight_version")
"""The ``/update_weights_from_tensor`` fields this transport sends (checked against SGLang's request)."""


class TensorTransport(TensorIpcTransport):
    """Pushes weights to colocated SGLang engines as CUDA IPC handles (``/update_weights_from_tensor``)."""

    name = "sglang_tensor"
    Settings = TensorTransportSettings
    engine_needs: ClassVar[tuple[str, ...]] = ("update_weights_from_tensor",)

    @classmethod
    def check_settings(cls, options: TensorTransportSettings, settings: MilesSettings) -> None:  # type: ignore[override]
        """SGLang engines, then what ``tensor_ipc`` needs (colocated, one engine TP rank per trainer
        rank, full weights, the fsdp trainer); anything else is refused here, naming the field."""
        problems = []
        engine = settings.rollout.engine
        if engine.name != "sglang":
            problems.append(f"transport: 'sglang_tensor' needs rollout.engine = 'sglang', got {engine.name!r}")
        try:
            super().check_settings(options, settings)
        except SettingsError as exc:
            problems.append(str(exc))
        if problems:
            raise SettingsError("\n".join(problems))

    def dump(self, tensors: list[tuple[str, torch.Tensor]]) -> str:
        """Handles of ``tensors`` in SGLang's own format (base64), made by SGLang's serializer: CUDA IPC handles
        on a GPU; on a CPU, PyTorch's shared-memory files (the ``file_system`` strategy: SGLang's scheduler, a
        process the trainer did not start, cannot take the default strategy's file descriptors)."""
        import torch.multiprocessing as mp
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        if all(t.is_cuda for _, t in tensors):
            monkey_patch_torch_reductions()  # handles name the device by UUID, as the engine expects
        else:  # (SGLang's patch reads a CUDA device from every tensor's handle: not applied on a CPU)
            mp.set_sharing_strategy("file_system")
        return str(MultiprocessingSerializer.serialize(tensors, output_str=True))
