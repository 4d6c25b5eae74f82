"""Routing replay (R3) and routing agreement in the fsdp trainer's Hugging Face MoE models.

Every MoE block of Qwen2-MoE, Qwen3-MoE and Mixtral calls its router (``mlp.gate``: a top-k router whose
``forward`` returns ``(router_logits, routing_weights, selected_experts)``). :func:`patch_routers` replaces
that forward, on the router instances of one model, with the same formula routed through a
:class:`~miles.training.routing.RouterReplay`: the softmax of the router logits, the experts chosen by the
replay (the engine's, with replay on) and their probabilities gathered from the softmax (so the gate weights
stay differentiable), renormalised as the model does. The MoE layers are numbered as the engine numbers
them (the decoder layers whose ``mlp.gate`` has a ``top_k``, in order), so layer ``i`` of the engine's
``routed_experts`` is router ``i`` here.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

from miles.training.routing import RouterReplay

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["patch_routers"]


def _routers(model: nn.Module) -> list[nn.Module]:
    from miles_fsdp.model import decoder_layers

    out = []
    for layer in decoder_layers(model):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "weight"):
            out.append(gate)
    return out


def patch_routers(model: nn.Module, *, replay: bool, invariant: bool = False) -> RouterReplay | None:
    """Route ``model``'s MoE routers through a new :class:`RouterReplay` (``replay``: use the rollout's
    experts); ``None`` for a dense model (nothing patched). ``invariant``: the router computes as the engine's
    deterministic one does (:func:`miles.engine.invariant.route`, the true on-policy forward)."""
    routers = _routers(model)
    if not routers:
        return None
    state = RouterReplay(replay=replay, num_layers=len(routers))
    for index, router in enumerate(routers):
        forward = _invariant_forward_with if invariant else _forward_with
        router.forward = types.MethodType(forward(state, index), router)
    return state


def _invariant_forward_with(state: RouterReplay, layer: int) -> Any:
    def forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from miles.engine import invariant

        def select(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
            return state.select(layer, probs, k)

        hidden = hidden_states.reshape(-1, self.hidden_dim)
        return invariant.route(hidden, self.weight, int(self.top_k), normalise=bool(self.norm_topk_prob), select=select)

    return forward


def _forward_with(state: RouterReplay, layer: int) -> Any:
    def forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        import torch
        import torch.nn.functional as F

        hidden = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        values, indices = state.select(layer, probs, int(self.top_k))
        qwen = hasattr(self, "norm_topk_prob")  # Mixtral always renormalises and keeps fp32 weights
        if not qwen or self.norm_topk_prob:
            values = values / values.sum(dim=-1, keepdim=True)
        if qwen:
            values = values.to(logits.dtype)
        return logits, values, indices

    return forward
