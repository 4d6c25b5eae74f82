"""From a rollout's groups to the batches each rank trains on.

Rank 0 holds the groups. It packs every sample into one :class:`~miles.training.batch.TrainBatch` and
broadcasts its tensors; each rank computes the trainer-side quantities the advantages need (critic
values, reference logprobs) on its own share, and they are all-gathered as tensors; rank 0 computes the
advantages from the groups and broadcasts them. Each rank then takes its contiguous share of every
optimizer step's samples and computes, on it, the old and reference logprobs the loss needs, before the
first optimizer step of the rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from miles.algorithms.base import AdvantageInputs
from miles.data.vision import is_vision_model
from miles.training.batch import TrainBatch
from miles.training.comm import all_gather_rows, broadcast_tensors
from miles.training.vision import attach_images
from miles.types import Sample, SampleGroup, SampleStatus

if TYPE_CHECKING:
    import torch

    from miles.algorithms.base import Algorithm
    from miles.training.trainer import DistContext, Trainer

__all__ = ["prepare_minibatches", "trainable"]

_UNTRAINABLE = (SampleStatus.FAILED, SampleStatus.ABORTED, SampleStatus.PENDING)


def trainable(sample: Sample) -> Sample:
    """A failed or aborted sample keeps its place (shapes stay uniform across ranks) but trains on nothing."""
    if sample.status in _UNTRAINABLE:
        return replace(sample, loss_mask=[0] * sample.response_length)
    return sample


def _rank_sizes(batch: TrainBatch, world_size: int) -> list[int]:
    """Response tokens of each rank's contiguous share of ``batch``."""
    per = len(batch) // world_size
    offsets = batch.response_offsets
    return [offsets[(r + 1) * per] - offsets[r * per] for r in range(world_size)]


def _gathered(local: torch.Tensor, batch: TrainBatch, dist: DistContext) -> torch.Tensor:
    """Each rank's packed ``[R]`` values of its share, as one ``[R]`` tensor of the whole batch."""
    return all_gather_rows(local.reshape(-1).float().cpu(), _rank_sizes(batch, dist.world_size))


def _per_group(packed: torch.Tensor, batch: TrainBatch, groups: Sequence[SampleGroup]) -> list[list[torch.Tensor]]:
    rows = list(packed.split(batch.response_lengths))
    out, i = [], 0
    for group in groups:
        out.append(rows[i : i + len(group)])
        i += len(group)
    return out


def _packed(per_group: list[list[torch.Tensor]]) -> torch.Tensor:
    import torch

    rows = [t.reshape(-1).float() for group in per_group for t in group]
    return torch.cat(rows) if rows else torch.zeros(0)


def prepare_minibatches(
    groups: Sequence[SampleGroup] | None,
    *,
    algorithm: Algorithm,
    trainer: Trainer,
    dist: DistContext,
    global_batch_size: int,
    temperature: float,
    on_policy: bool = False,
) -> list[TrainBatch]:
    """This rank's share of each optimizer step of the rollout, with every field the algorithm needs.

    :param groups: the rollout's groups on rank 0 (``None`` on the other ranks).
    :param on_policy: the samples come from the trainer's current weights (sync mode). With a single
        optimizer step the "old" logprobs are then the step's own logprobs before the update: the forward
        that would compute them is skipped and the loss uses its detached logprobs (ratio exactly 1).
    """
    needs = algorithm.needs
    driver = dist.rank == 0
    tensors = None
    if driver:
        assert groups is not None, "rank 0 must pass the rollout's groups"
        groups = [SampleGroup(g.group_id, [trainable(s) for s in g.samples]) for g in groups]
        samples = [s for g in groups for s in g.samples]
        if len(samples) % global_batch_size:
            raise ValueError(f"{len(samples)} samples do not split into optimizer steps of {global_batch_size}")
        everything = TrainBatch.from_samples(samples)
        model_path = trainer.train_settings.model_path
        if model_path is not None and is_vision_model(model_path):  # pixel values for the trainer's forwards
            attach_images(everything, samples, model_path)
        if not needs.rollout:
            everything.rollout_logprobs = None  # SFT targets were not sampled by any engine
        tensors = everything.to_tensors()
    everything = TrainBatch.from_tensors(broadcast_tensors(tensors))
    mine = everything.shard(dist.rank, dist.world_size)

    values = ref_for_advantages = None
    if needs.values:
        values = _gathered(trainer.compute_values(mine), everything, dist)
    if needs.ref_logprobs_for_advantages:
        ref = trainer.compute_logprobs(mine, model="ref", temperature=temperature).logprobs
        ref_for_advantages = _gathered(ref, everything, dist)

    computed = None
    if driver:
        assert groups is not None
        inputs = AdvantageInputs(
            groups,
            values=None if values is None else _per_group(values, everything, groups),
            ref_logprobs=None if ref_for_advantages is None else _per_group(ref_for_advantages, everything, groups),
        )
        result = algorithm.compute_advantages(inputs)
        computed = {"advantages": _packed(result.advantages)}
        if result.returns is not None:
            computed["returns"] = _packed(result.returns)
    computed = broadcast_tensors(computed)
    for name, value in computed.items():
        everything.set_token_field(name, value)
    if values is not None:
        everything.set_token_field("old_values", values)

    batches: list[TrainBatch] = []
    single_on_policy_step = on_policy and len(everything) == global_batch_size
    for start in range(0, len(everything), global_batch_size):
        share = everything.select(range(start, start + global_batch_size)).shard(dist.rank, dist.world_size)
        if needs.old_logprobs and not single_on_policy_step:
            out = trainer.compute_logprobs(share, model="actor", temperature=temperature)
            share.set_token_field("old_logprobs", out.logprobs)
        if needs.ref_logprobs:
            out = trainer.compute_logprobs(share, model="ref", temperature=temperature)
            share.set_token_field("ref_logprobs", out.logprobs)
        batches.append(share)
    return batches
