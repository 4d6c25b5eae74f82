"""Routing replay (R3) and routing agreement in the megatron trainer's MoE layers.

Megatron-Core's ``TopKRouter`` has a replay hook (``TransformerConfig.moe_enable_routing_replay``): each
router owns a ``RouterReplay`` whose ``get_replay_topk(scores, topk, ...)`` chooses the experts inside
``topk_routing_with_score_function``, on the scores the top-k is taken of (the softmax probabilities with
``moe_router_pre_softmax``, else the logits, whose top-k softmax is HF's renormalised weights). The bridge
turns the hook on for MoE models; :func:`install` points every router of the actor at one
:class:`miles.training.routing.RouterReplay`, which returns the engine's experts where the batch has them
(the gathered scores keep their gradient) and the router's own top-k elsewhere, and counts agreement.

The MoE layers are numbered as the engine numbers them: the model's MoE layers in order (Megatron's
``moe_layer_freq`` pattern over the global ``layer_number``), so each pipeline stage's routers read their
own columns of the engine's ``routed_experts``. The tokens a router sees are the micro-batch's ``[s, b]``
block flattened sequence-major (:func:`router_rows`), after the sequence-parallel split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.training.routing import RouterReplay

if TYPE_CHECKING:
    import torch

    from miles_megatron.microbatch import MicroBatch

__all__ = ["install", "moe_layer_pattern", "router_rows"]


def moe_layer_pattern(config: Any) -> list[int]:
    """``1`` for each MoE layer of the model (all its layers, every pipeline stage), ``0`` for dense ones."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return [int(bool(v)) for v in freq]


def install(module: Any, *, replay: bool) -> RouterReplay | None:
    """Route ``module``'s MoE routers through a new :class:`RouterReplay` (``replay``: the engine's experts);
    ``None`` for a dense model."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
    if not routers:
        return None
    pattern = moe_layer_pattern(routers[0].config)
    index = {n + 1: sum(pattern[:n]) for n in range(len(pattern)) if pattern[n]}
    state = RouterReplay(replay=replay, num_layers=sum(pattern))
    for router in routers:
        if router.router_replay is None:
            raise RuntimeError("megatron routing replay: the router was built without moe_enable_routing_replay")
        if router.config.moe_router_group_topk:
            raise ValueError("routing replay: group-limited routing (moe_router_group_topk) is not supported")
        router.router_replay.get_replay_topk = _select_with(state, index[int(router.layer_number)])
    return state


def _select_with(state: RouterReplay, layer: int) -> Any:
    def get_replay_topk(
        scores: torch.Tensor,
        topk: int,
        num_groups: Any = None,
        group_topk: Any = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return state.select(layer, scores, topk)

    return get_replay_topk


def router_rows(mb: MicroBatch, *, tp_rank: int, tp_size: int, sequence_parallel: bool) -> torch.Tensor | None:
    """The engine's experts (``[T, layers, k]``, ``-1`` = none) of the tokens this rank's routers see for
    ``mb``, in their order: the ``[s, b]`` block sequence-major, this rank's slice of ``s`` under sequence
    parallel; ``None`` without routing data."""
    routed = mb.routed_experts
    if routed is None:
        return None
    rows = routed.transpose(0, 1)  # [s, b, layers, k], as Megatron lays hidden states out
    if sequence_parallel and tp_size > 1:
        chunk = rows.shape[0] // tp_size
        rows = rows[tp_rank * chunk : (tp_rank + 1) * chunk]
    return rows.reshape(-1, *rows.shape[2:])
