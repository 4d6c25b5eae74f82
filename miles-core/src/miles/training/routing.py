"""MoE rollout routing replay (R3) and routing agreement, for every trainer backend.

The engine reports, for each token it fed to the model, the top-k experts of every MoE layer
(:attr:`miles.types.Sample.routed_experts`). They reach the trainer as one compact tensor per batch,
``TrainBatch.token_tensors[ROUTED_EXPERTS]`` (``[N, layers, k]`` int16, aligned with ``TrainBatch.tokens``;
``-1`` where the engine routed nothing: the last token of each sequence, samples without routing data).

A backend replays them with a :class:`RouterReplay`: before a forward it hands it the rows of the tokens
of that forward (:meth:`RouterReplay.set_rows`, e.g. ``batch.token_tensor_rows(ROUTED_EXPERTS, indices)``
in the order the tokens are packed); each MoE layer's router then calls :meth:`RouterReplay.select` with
its softmax probabilities, which returns the rollout's experts (where recorded) and their probabilities —
gathered from the trainer's own softmax, so the gate weights keep their gradient. Whether replay is on or
off, ``select`` counts how often the trainer's own top-k equals the rollout's (:class:`RoutingStats`,
the ``fidelity/routing_agreement`` metric).

The FSDP trainer patches the Hugging Face routers with it (``miles_fsdp.routing``). A Megatron-Core trainer
needs the same two calls: ``set_rows`` with the micro-batch's rows in its packing order (after any
sequence-parallel split, the rows of its own tokens), and, in ``TopKRouter.routing``, ``select(layer,
probs, topk)`` in place of its ``torch.topk`` (before the expert-capacity / token-dispatch step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles.types import Sample

if TYPE_CHECKING:
    import torch

__all__ = ["ROUTED_EXPERTS", "RouterReplay", "RoutingStats", "pack_routed_experts"]

ROUTED_EXPERTS = "routed_experts"
"""Name of the ``[N, layers, k]`` int16 token tensor of the engine's routed experts (``-1``: none)."""


def pack_routed_experts(samples: Sequence[Sample]) -> torch.Tensor | None:
    """``[N, layers, k]`` int16 over the tokens of ``samples`` in order, or ``None`` when no sample has
    routing data. A sample's rows cover its first ``len(routed)`` positions (the engine routes every token
    but the last); the rest, and samples without data, are ``-1``."""
    import torch

    shapes = {s.routed_experts_shape[1:] for s in samples if s.routed_experts_shape is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"Sample.routed_experts_shape: samples of one batch have different (layers, k): {shapes}")
    layers, k = next(iter(shapes))
    total = sum(len(s.tokens) for s in samples)
    out = torch.full((total, layers, k), -1, dtype=torch.int16)
    offset = 0
    for i, sample in enumerate(samples):
        n = len(sample.tokens)
        if sample.routed_experts is not None and sample.routed_experts_shape is not None:
            rows = sample.routed_experts_shape[0]
            if rows > n:
                raise ValueError(
                    f"Sample {i} (group {sample.group_id}, index {sample.index}): routed_experts has {rows} rows "
                    f"for a sequence of {n} tokens"
                )
            array = torch.frombuffer(bytearray(sample.routed_experts), dtype=torch.int32).reshape(rows, layers, k)
            if array.numel() and (int(array.max()) > 32767 or int(array.min()) < 0):
                raise ValueError(f"Sample {i}: routed expert ids must be in [0, 32767]")
            out[offset : offset + rows] = array.to(torch.int16)
        offset += n
    return out


class RoutingStats:
    """Per MoE layer: tokens with rollout routing, and how many of them the trainer's own top-k matched (as a
    set of experts)."""

    def __init__(self) -> None:
        self.agree: dict[int, int] = {}
        self.total: dict[int, int] = {}

    def add(self, layer: int, own: torch.Tensor, rollout: torch.Tensor) -> None:
        """Count the rows of ``own`` / ``rollout`` (``[T, k]`` expert ids; rollout rows with ``-1`` skipped)."""
        known = (rollout >= 0).all(-1)
        if not bool(known.any()):
            return
        same = (own[known].sort(-1).values == rollout[known].to(own.dtype).sort(-1).values).all(-1)
        self.agree[layer] = self.agree.get(layer, 0) + int(same.sum())
        self.total[layer] = self.total.get(layer, 0) + int(known.sum())

    def reset(self) -> None:
        self.agree.clear()
        self.total.clear()

    def metrics(self, num_layers: int, *, reduce: bool = True) -> dict[str, float]:
        """``fidelity/routing_agreement`` (over all layers' tokens) and ``..._layer<i>`` per layer, summed over
        the ranks of the default process group first (a collective when ``reduce``); empty without data."""
        import torch
        import torch.distributed as dist

        counts = torch.tensor(
            [[self.agree.get(i, 0), self.total.get(i, 0)] for i in range(num_layers)], dtype=torch.float64
        ).reshape(num_layers, 2)
        if reduce and dist.is_initialized() and dist.get_world_size() > 1:
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            counts = counts.to(device)
            dist.all_reduce(counts)
            counts = counts.cpu()
        if float(counts[:, 1].sum()) == 0:
            return {}
        out = {"fidelity/routing_agreement": float(counts[:, 0].sum() / counts[:, 1].sum())}
        for i in range(num_layers):
            if counts[i, 1] > 0:
                out[f"fidelity/routing_agreement_layer{i}"] = float(counts[i, 0] / counts[i, 1])
        return out


class RouterReplay:
    """The rollout's experts for the tokens of the next forward, and what each MoE layer's router does with
    them.

    :param replay: use the rollout's experts (R3); ``False`` only measures agreement.
    :param num_layers: MoE layers of the model (the metrics' per-layer entries).
    """

    def __init__(self, *, replay: bool, num_layers: int = 0) -> None:
        self.replay = replay
        self.num_layers = num_layers
        self.stats = RoutingStats()
        self.rows: torch.Tensor | None = None
        """``[T, layers, k]`` rollout experts of the tokens the routers see next, or ``None``."""
        self.measure = True
        """Count agreement (off for forwards whose tokens were already counted)."""

    def set_rows(self, rows: torch.Tensor | None) -> None:
        """The rollout experts (``[T, layers, k]``, ``-1`` = none) of the tokens of the next router calls, in
        the order the routers see them; ``None``: the routers choose on their own."""
        self.rows = rows

    def select(self, layer: int, probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, indices)`` (``[T, k]``) of router ``layer`` given its softmax ``probs`` (``[T, E]``):
        the rollout's experts where recorded (with replay on), the router's own top-k elsewhere; the weights
        are ``probs`` gathered at the indices (differentiable), before any renormalisation."""
        import torch

        own_values, own = torch.topk(probs, top_k, dim=-1)
        if self.rows is None:
            return own_values, own
        if self.rows.shape[0] != probs.shape[0]:
            raise ValueError(
                f"routing replay: router {layer} sees {probs.shape[0]} tokens, the batch has rollout experts for "
                f"{self.rows.shape[0]}"
            )
        rollout = self.rows[:, layer].to(device=probs.device, dtype=torch.long)
        if self.measure:
            self.stats.add(layer, own, rollout)
        if not self.replay:
            return own_values, own
        known = (rollout >= 0).all(-1, keepdim=True)
        indices = torch.where(known, rollout, own)
        return probs.gather(-1, indices), indices
