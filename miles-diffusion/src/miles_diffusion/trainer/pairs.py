"""From a :class:`~miles.training.batch.TrainBatch` of trajectories to transformer forwards over
``(x_t -> x_t')`` pairs.

A trajectory's response "tokens" are its SDE steps; ``TrainBatch.response_tensors`` holds, per step, the
latent before and after it, the timestep, the two noise levels, ``eta``, the guidance scale and the
prompt encoding's length — everything that defines the step's Gaussian besides the weights. Each pair is
an independent forward, so pairs of many trajectories share one batched forward. Micro-batches hold whole
trajectories (every loss aggregation stays exact) of at most ``max_pairs`` pairs (a longer trajectory is
a micro-batch alone); every rank runs the same number of forwards (FSDP's collectives), padding with
empty ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from miles.errors import SettingsError
from miles_diffusion.denoise import PromptEmbeddings, encode_prompts, prompt_texts, velocity
from miles_diffusion.rollout import TRAJECTORY_TENSORS
from miles_diffusion.sde import gaussian_logprob, sde_mean_std

if TYPE_CHECKING:
    from miles.training.batch import TrainBatch

__all__ = ["PairBatch", "StepDistribution", "encode_batch_prompts", "plan_micro_batches", "step_distribution"]


@dataclass
class PairBatch:
    """The pairs of some whole trajectories of a batch (empty: a padding forward)."""

    indices: list[int]
    """The trajectories (sequence indices of the batch)."""
    rows: torch.Tensor
    """``[P]`` their response rows (pairs), in order."""
    sequence_of_row: torch.Tensor
    """``[P]`` the sequence each pair belongs to."""
    response_lengths: list[int]

    @property
    def is_empty(self) -> bool:
        return not self.indices


def _check_tensors(batch: TrainBatch) -> None:
    missing = [name for name in TRAJECTORY_TENSORS if name not in batch.response_tensors]
    if missing:
        raise SettingsError(
            f"TrainBatch.response_tensors lacks {', '.join(missing)}: the diffusion trainer trains on image "
            'trajectories (rollout.engine = "diffusion", rollout.function = "diffusion")'
        )


def plan_micro_batches(batch: TrainBatch, max_pairs: int, device: torch.device) -> Iterator[PairBatch]:
    """This rank's micro-batches, as many as the rank with the most (padding with empty ones)."""
    _check_tensors(batch)
    lengths = batch.response_lengths
    offsets = batch.response_offsets
    groups: list[list[int]] = []
    current: list[int] = []
    pairs = 0
    for i, n in enumerate(lengths):
        if current and pairs + n > max_pairs:
            groups.append(current)
            current, pairs = [], 0
        current.append(i)
        pairs += n
    if current:
        groups.append(current)
    count = torch.tensor([len(groups)], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    for k in range(int(count.item())):
        indices = groups[k] if k < len(groups) else []
        rows = [torch.arange(offsets[i], offsets[i + 1]) for i in indices]
        seqs = [torch.full((lengths[i],), i, dtype=torch.int64) for i in indices]
        yield PairBatch(
            indices=indices,
            rows=torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64),
            sequence_of_row=torch.cat(seqs) if seqs else torch.zeros(0, dtype=torch.int64),
            response_lengths=[lengths[i] for i in indices],
        )


def _uniform(batch: TrainBatch, name: str) -> float:
    values = batch.response_tensors[name]
    if values.numel() == 0:
        return float("nan")
    first = float(values.reshape(-1)[0])
    if not bool((values == values.reshape(-1)[0]).all()):
        raise ValueError(f"the batch mixes several values of {name!r} (one engine configuration per run)")
    return first


def encode_batch_prompts(pipe: Any, tokenizer: Any, batch: TrainBatch, device: torch.device) -> PromptEmbeddings:
    """Every trajectory's prompt embeddings (``[B, ...]``), encoded once per step by the frozen text encoders."""
    prompts = [batch.sequence(i)[: int(batch.prompt_lengths[i])].tolist() for i in range(len(batch))]
    guidance = _uniform(batch, "guidance")
    length = _uniform(batch, "text_lengths")
    if guidance != guidance:  # no pairs at all
        guidance, length = 1.0, 1.0
    return encode_prompts(
        pipe, prompt_texts(tokenizer, prompts), guidance_scale=guidance, max_sequence_length=int(length), device=device
    )


@dataclass
class StepDistribution:
    """The step Gaussians of a micro-batch's pairs under one transformer."""

    mean: torch.Tensor
    std: torch.Tensor
    logprobs: torch.Tensor
    """``[P]`` log-probability of each recorded next latent."""


def _dummy(batch: TrainBatch, device: torch.device) -> dict[str, torch.Tensor]:
    """One all-zero pair shaped like the batch's (a padding forward that contributes nothing)."""
    latents = batch.response_tensors["latents"]
    shape = (1, *latents.shape[1:])
    return {
        "latents": torch.zeros(shape, device=device),
        "next_latents": torch.zeros(shape, device=device),
        "timesteps": torch.full((1,), 500.0, device=device),
        "sigmas": torch.tensor([[0.5, 0.4]], device=device),
        "noise_levels": torch.full((1,), 0.7, device=device),
    }


def step_distribution(
    module: Any, batch: TrainBatch, mb: PairBatch, prompts: PromptEmbeddings, device: torch.device
) -> StepDistribution:
    """The transformer's step Gaussians for ``mb``'s pairs (with gradient when ``module`` is in grad mode)."""
    tensors = batch.response_tensors
    if mb.is_empty:
        pair = _dummy(batch, device)
        index = torch.zeros(1, dtype=torch.int64)
        guidance = 1.0
        embeds = PromptEmbeddings(prompts.embeds[:1] * 0.0, prompts.pooled[:1] * 0.0)
    else:
        pair = {
            name: tensors[name][mb.rows].to(device)
            for name in ("latents", "next_latents", "timesteps", "sigmas", "noise_levels")
        }
        index = mb.sequence_of_row
        guidance = float(tensors["guidance"][mb.rows[0]])
        embeds = prompts.select(index.to(prompts.embeds.device))
    v = velocity(module, pair["latents"], pair["timesteps"], embeds, guidance)
    sigmas = pair["sigmas"]
    mean, std = sde_mean_std(pair["latents"], v, sigmas[:, 0], sigmas[:, 1], pair["noise_levels"])
    return StepDistribution(mean, std, gaussian_logprob(pair["next_latents"], mean, std))
