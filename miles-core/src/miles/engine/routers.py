"""The MoE routers of the local engine's model: which experts each chose in the last forward (routing replay's
data, ``routed_experts``), and, for deterministic inference, their blocks on the batch-invariant ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Routers"]


class Routers:
    """The MoE layers of ``layers`` (decoder layers whose ``mlp.gate`` has a ``top_k``, in order: layer ``i`` of
    ``routed_experts`` is the ``i``-th of them), each router's top-k indices recorded by a forward hook.

    :param invariant: compute each MoE block with :func:`miles.engine.invariant.install_moe` (the recording
        hooks keep firing: the router is still called as a module).
    """

    def __init__(self, layers: list[Any], *, invariant: bool) -> None:
        self.layers: list[int] = []
        self.topk = 0
        self._routed: list[torch.Tensor | None] = []
        for i, layer in enumerate(layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(gate, "top_k"):
                continue
            if invariant:
                from miles.engine.invariant import install_moe

                install_moe(layer.mlp)
            self.layers.append(i)
            self.topk = int(gate.top_k)
            self._routed.append(None)
            gate.register_forward_hook(self._hook(len(self.layers) - 1))

    def _hook(self, slot: int) -> Callable[..., None]:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            self._routed[slot] = output[2].to(torch.int32)

        return hook

    def take(self) -> torch.Tensor | None:
        """``[tokens, moe_layers, topk]`` int32 of the last forward (``None`` for dense models)."""
        if not self.layers:
            return None
        return torch.stack([r for r in self._routed if r is not None], dim=1).cpu()
