"""From a rollout's groups to the batches each rank trains on.

Every rank holds the same groups (broadcast from rank 0) and computes the same advantages; each rank
then takes its contiguous share of every optimizer step's samples. Trainer-side quantities the algorithm
needs (old / reference logprobs, critic values) are computed by each rank on its own share, before the
first optimizer step of the rollout, and all-gathered when the advantages need them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from miles.driver.comm import all_gather_json
from miles.training.batch import TrainBatch
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


def _gather_per_sample(local: list[torch.Tensor]) -> list[torch.Tensor]:
    import torch

    rows = all_gather_json([t.tolist() for t in local])
    return [torch.tensor(row, dtype=torch.float32) for rank_rows in rows for row in rank_rows]


def _regroup(flat: list[torch.Tensor], groups: Sequence[SampleGroup]) -> list[list[torch.Tensor]]:
    out, i = [], 0
    for group in groups:
        out.append(flat[i : i + len(group)])
        i += len(group)
    return out


def prepare_minibatches(
    groups: Sequence[SampleGroup],
    *,
    algorithm: Algorithm,
    trainer: Trainer,
    dist: DistContext,
    global_batch_size: int,
    temperature: float,
    on_policy: bool = False,
) -> list[TrainBatch]:
    """This rank's share of each optimizer step of the rollout, with every field the algorithm needs.

    :param on_policy: the samples come from the trainer's current weights (sync mode). With a single
        optimizer step the "old" logprobs are then the step's own logprobs before the update: the forward
        that would compute them is skipped and the loss uses its detached logprobs (ratio exactly 1).
    """
    groups = [SampleGroup(g.group_id, [trainable(s) for s in g.samples]) for g in groups]
    samples = [s for g in groups for s in g.samples]
    if len(samples) % global_batch_size:
        raise ValueError(f"{len(samples)} samples do not split into optimizer steps of {global_batch_size}")
    needs = algorithm.needs
    everything = TrainBatch.from_samples(samples)
    mine = everything.shard(dist.rank, dist.world_size)

    values = ref_for_advantages = None
    if needs.values:
        values = _regroup(_gather_per_sample(trainer.compute_values(mine)), groups)
    if needs.ref_logprobs_for_advantages:
        ref = trainer.compute_logprobs(mine, model="ref", temperature=temperature).logprobs
        ref_for_advantages = _regroup(_gather_per_sample(ref), groups)
    advantages = algorithm.compute_advantages(groups, values, ref_logprobs=ref_for_advantages)
    returns = algorithm.compute_returns(groups, values, ref_logprobs=ref_for_advantages)
    flat_adv = [a.tolist() for per_group in advantages for a in per_group]
    flat_ret = None if returns is None else [r.tolist() for per_group in returns for r in per_group]
    flat_values = None if values is None else [v.tolist() for per_group in values for v in per_group]

    batches: list[TrainBatch] = []
    for start in range(0, len(samples), global_batch_size):
        stop = start + global_batch_size
        step = TrainBatch.from_samples(samples[start:stop], advantages=flat_adv[start:stop])
        if not needs.rollout:
            step.rollout_logprobs = None  # SFT targets were not sampled by any engine
        if flat_ret is not None:
            step.returns = flat_ret[start:stop]
        if flat_values is not None:
            step.old_values = flat_values[start:stop]
        share = step.shard(dist.rank, dist.world_size)
        single_on_policy_step = on_policy and len(samples) == global_batch_size
        if needs.old_logprobs and not single_on_policy_step:
            out = trainer.compute_logprobs(share, model="actor", temperature=temperature)
            share.old_logprobs = [t.tolist() for t in out.logprobs]
        if needs.ref_logprobs:
            out = trainer.compute_logprobs(share, model="ref", temperature=temperature)
            share.ref_logprobs = [t.tolist() for t in out.logprobs]
        share.validate()
        batches.append(share)
    return batches
