"""One optimizer step of the diffusion trainer: micro-batches of pairs, the algorithm's loss, exact
aggregation over micro-batches and ranks, clipping, the optimizer and the metrics.

As in the FSDP trainer, the trained-pair and trajectory counts of the whole step are all-reduced first,
each micro-batch back-propagates its share of the step loss, and FSDP sums gradients over ranks: the
gradient equals that of the whole step's loss in one process. Metric names agree across ranks through
JSON (never pickles).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from miles.algorithms.aggregation import aggregate_loss
from miles.training.batch import TOKEN_FIELDS
from miles.training.step_metrics import StepMetrics, count_step
from miles_diffusion.algorithm import DiffusionAlgorithm, DiffusionLossInputs
from miles_diffusion.sde import gaussian_mean_kl
from miles_diffusion.trainer.pairs import encode_batch_prompts, plan_micro_batches, step_distribution
from miles_fsdp.optim import clip_grad_norm

if TYPE_CHECKING:
    from miles.algorithms.base import Algorithm
    from miles.settings.model import TrainSettings
    from miles.training.batch import TrainBatch

__all__ = ["StepContext", "run_train_step"]


@dataclass
class StepContext:
    """What one optimizer step needs from the trainer."""

    device: torch.device
    actor: Any
    ref: Any
    """The frozen reference transformer (``None`` without a KL)."""
    optimizer: Any
    scheduler: Any
    pipe: Any
    """Text encoders and tokenizers (frozen)."""
    train: TrainSettings
    max_pairs: int


def _field(batch: TrainBatch, name: str, rows: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    value = getattr(batch, name)
    return None if value is None else value[rows].to(device)


def run_train_step(ctx: StepContext, batch: TrainBatch, algorithm: Algorithm[Any]) -> dict[str, float]:
    """Run one step over this rank's share; returns metrics reduced over ranks."""
    if not isinstance(algorithm, DiffusionAlgorithm):
        raise TypeError(
            f'algorithm {algorithm.name!r} is not a diffusion algorithm: train.backend = "diffusion" trains '
            'with one (algorithm = "flow_grpo")'
        )
    if batch.advantages is None:
        raise ValueError(f"algorithm {algorithm.name!r}: TrainBatch.advantages is None; compute advantages first")
    device = ctx.device
    with_kl = algorithm.kl_coef > 0.0
    if with_kl and ctx.ref is None:
        raise RuntimeError("the reference transformer is not loaded")
    counts = count_step(
        batch.loss_mask, len(batch), batch.num_response_tokens, seq_len_norm=algorithm.seq_len_norm, device=device
    )
    denominators = counts.denominators
    prompts = encode_batch_prompts(ctx.pipe, ctx.pipe.tokenizer, batch, device)
    actor = ctx.actor
    actor.train()
    sums = StepMetrics(device)

    for mb in plan_micro_batches(batch, ctx.max_pairs, device):
        policy = step_distribution(actor, batch, mb, prompts, device)
        if mb.is_empty:  # keeps this rank's collectives in step with the others; contributes nothing
            (policy.logprobs.sum() * 0.0).backward()
            if with_kl:
                with torch.no_grad():
                    step_distribution(ctx.ref, batch, mb, prompts, device)
            continue
        kl = None
        if with_kl:
            with torch.no_grad():
                reference = step_distribution(ctx.ref, batch, mb, prompts, device)
            kl = gaussian_mean_kl(policy.mean, reference.mean, policy.std)
        mask = batch.loss_mask[mb.rows].to(device)
        fields = {name: _field(batch, name, mb.rows, device) for name in TOKEN_FIELDS[1:]}
        inputs = DiffusionLossInputs(
            logprobs=policy.logprobs, loss_mask=mask, response_lengths=mb.response_lengths, kl=kl, **fields
        )
        output = algorithm.loss(inputs)
        loss = aggregate_loss(output.per_token_loss, mask, mb.response_lengths, algorithm.aggregation, denominators)
        loss.backward()
        sums.add_loss(loss)
        for name, per_pair in output.metrics.items():
            sums.add(name, per_pair, mask)
        if fields["rollout_logprobs"] is not None:
            rollout = fields["rollout_logprobs"]
            sums.add("train_rollout_logprob_abs_diff", (policy.logprobs.detach() - rollout).abs(), mask)

    metrics: dict[str, float] = {
        "grad_norm": clip_grad_norm(actor.parameters(), ctx.train.grad_clip, device),
        "lr": float(ctx.optimizer.param_groups[0]["lr"]),
    }
    ctx.optimizer.step()
    ctx.scheduler.step()
    ctx.optimizer.zero_grad(set_to_none=True)

    metrics.update(sums.reduce(denominators.num_tokens, device))
    metrics["pairs"] = counts.tokens
    metrics["trained_pairs"] = float(denominators.num_tokens)
    metrics["trajectories"] = float(denominators.num_sequences)
    return metrics
