"""One optimizer step of the FSDP trainer: micro-batches, the algorithm's loss, exact aggregation,
gradient clipping, the optimizer and the metrics.

Exactness across micro-batches and ranks: the trained-token and sequence counts of the whole step are
all-reduced first (:class:`~miles.algorithms.aggregation.StepDenominators`); each micro-batch adds its
share (:func:`~miles.algorithms.aggregation.aggregate_loss`) and back-propagates it; FSDP then *sums*
the gradients over ranks (its averaging is switched off in :func:`miles_fsdp.model.shard_model`). The
gradient equals that of the loss over the whole batch in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from miles.algorithms.aggregation import StepDenominators, aggregate_loss
from miles.algorithms.base import LossInputs
from miles.errors import NonFiniteStepError
from miles.training.batch import TOKEN_FIELDS
from miles.training.guards import refuse_non_finite
from miles.training.logprobs import token_logprobs, topk_logprobs
from miles.training.step_metrics import StepMetrics, count_step
from miles_fsdp.microbatch import PackedMicroBatch
from miles_fsdp.optim import clip_grad_norm
from miles_fsdp.true_on_policy import with_exact_values

if TYPE_CHECKING:
    from torch import nn

    from miles.algorithms.base import Algorithm
    from miles.settings.model import TrainSettings
    from miles.training.batch import TrainBatch

__all__ = ["StepContext", "run_train_step"]


@dataclass
class StepContext:
    """What one optimizer step needs from the trainer."""

    device: torch.device
    actor: nn.Module
    critic: nn.Module | None
    parts: dict[str, tuple[Any, Any, Any]]
    """``{"actor": (model, optimizer, scheduler), "critic": ...}``."""
    train: TrainSettings
    empty_cache: bool
    """Empty the CUDA cache after the step."""
    micro_batches: Callable[..., Iterator[PackedMicroBatch]]
    """``(batch, subset=None)``: the micro-batches of ``batch`` (of the sequences in ``subset``), as many on every
    rank."""
    logits: Callable[[nn.Module, PackedMicroBatch], torch.Tensor]
    values: Callable[[PackedMicroBatch], torch.Tensor]
    fused_logprobs: (
        Callable[[nn.Module, PackedMicroBatch, float, bool, bool], tuple[torch.Tensor, torch.Tensor | None] | None]
        | None
    ) = None
    """``(model, mb, temperature, with_entropy, entropy_grad) -> (logprobs, entropy)`` through the fused LM head
    (:mod:`miles_fsdp.fused_head`), or ``None`` (the model has none: score its full logits)."""
    step: int = 0
    """Optimizer steps taken before this one."""
    exact_logprobs: list[torch.Tensor] | None = None
    """``train.true_on_policy``: per sequence, the engine's logprobs (the loss sees these values exactly, with
    the gradient of the trainer's own forward: :func:`miles_fsdp.true_on_policy.with_exact_values`)."""
    score_without_backward: bool = False
    """Score the sequences that train nothing (:func:`inert_sequences`) without a backward pass
    (``[train.backend] skip_zero_advantage_backward``)."""


def inert_sequences(batch: TrainBatch, algorithm: Algorithm) -> list[int]:
    """The sequences of ``batch`` whose trained tokens all have advantage exactly 0, where the algorithm's loss
    then adds nothing to the gradient (:attr:`~miles.algorithms.base.Algorithm.zero_advantage_trains_nothing`);
    none otherwise, and none without advantages."""
    if batch.advantages is None or not algorithm.zero_advantage_trains_nothing:
        return []
    live = ((batch.advantages != 0) & (batch.loss_mask != 0)).tolist()
    bounds = batch.response_offsets
    return [i for i in range(len(batch)) if not any(live[bounds[i] : bounds[i + 1]])]


def _any_over_ranks(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag or-ed over the world (one all-reduce)."""
    import torch.distributed as dist

    value = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return [bool(v) for v in value.tolist()]


def run_train_step(
    ctx: StepContext, batch: TrainBatch, algorithm: Algorithm, *, temperature: float
) -> dict[str, float]:
    """Run one step; returns metrics reduced over ranks."""
    if batch.advantages is None and algorithm.needs.rollout:
        raise ValueError(f"algorithm {algorithm.name!r}: TrainBatch.advantages is None; compute advantages first")
    device = ctx.device
    needs_values = algorithm.needs.values
    topk = algorithm.needs.teacher_topk
    if topk > 0 and (batch.teacher_topk_ids is None or batch.teacher_topk < topk):
        have = "none" if batch.teacher_topk_ids is None else f"top-{batch.teacher_topk}"
        raise ValueError(
            f"algorithm {algorithm.name!r} needs the teacher's top-{topk} per response token, the batch has {have}: "
            "score the samples with a teacher ([rollout.teacher] url, top_k >= the algorithm's distill_topk)"
        )
    if needs_values and ctx.critic is None:
        raise RuntimeError(f"algorithm {algorithm.name!r} needs values: call setup(need_values=True)")

    counts = count_step(
        batch.loss_mask, len(batch), batch.num_tokens, seq_len_norm=algorithm.seq_len_norm, device=device
    )
    denominators = counts.denominators

    actor, critic = ctx.actor, ctx.critic
    actor.train()
    if critic is not None:
        critic.train()
    sums = StepMetrics(device)

    fused = ctx.fused_logprobs if topk == 0 and ctx.exact_logprobs is None else None
    if ctx.score_without_backward and batch.advantages is not None and algorithm.zero_advantage_trains_nothing:
        # trained first, then the inert sequences scored without a backward pass; both phases on every rank
        # (each agrees its micro-batch count over the ranks), whether or not this rank has inert sequences
        inert = inert_sequences(batch, algorithm)
        rest = sorted(set(range(len(batch))) - set(inert))
        any_rest, any_inert = _any_over_ranks([bool(rest), bool(inert)], device)
        phases = [(ctx.micro_batches(batch, rest), True)] if any_rest else []
        if any_inert:
            phases.append((ctx.micro_batches(batch, inert), False))
    else:
        phases = [(ctx.micro_batches(batch), True)]
    backward_ran = False
    for micro_batches, backward in phases:
        for mb in micro_batches:
            with torch.enable_grad() if backward else torch.no_grad():
                backward_ran |= _micro_step(ctx, batch, algorithm, mb, sums, denominators, temperature, fused, backward)
    if not backward_ran:  # every sequence inert: zero gradients, so that the optimizer still steps (momentum)
        for model, _, _ in ctx.parts.values():
            for param in model.parameters():
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)

    train = ctx.train
    parts = ctx.parts
    metrics: dict[str, float] = {}
    for key, (model, optimizer, scheduler) in parts.items():
        if key == "critic" and not needs_values:
            continue
        norm = clip_grad_norm(model.parameters(), train.grad_clip, device)  # reduced over the world
        try:
            refuse_non_finite(ctx.step + 1, **{f"{key} grad_norm": norm})
        except NonFiniteStepError:
            for _, opt, _ in parts.values():  # the refused gradients must not leak into the next step
                opt.zero_grad(set_to_none=True)
            raise
        metrics["grad_norm" if key == "actor" else f"{key}_grad_norm"] = norm
        metrics["lr" if key == "actor" else f"{key}_lr"] = float(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    if ctx.empty_cache and device.type == "cuda":
        torch.cuda.empty_cache()

    metrics.update(sums.reduce(denominators.num_tokens, device))
    metrics["tokens"] = counts.tokens
    metrics["trained_tokens"] = float(denominators.num_tokens)
    metrics["sequences"] = float(denominators.num_sequences)
    return metrics


def _micro_step(
    ctx: StepContext,
    batch: TrainBatch,
    algorithm: Algorithm,
    mb: PackedMicroBatch,
    sums: StepMetrics,
    denominators: StepDenominators,
    temperature: float,
    fused: Any,
    backward: bool,
) -> bool:
    """One micro-batch: its forward, the algorithm's loss and metrics, and (``backward``) its backward pass;
    returns whether a backward pass ran."""
    needs = algorithm.needs
    topk, entropy_grad = needs.teacher_topk, needs.entropy
    actor = ctx.actor
    scored = fused(actor, mb, temperature, True, entropy_grad) if fused is not None else None
    logits = ctx.logits(actor, mb) if scored is None else scored[0]
    values = ctx.values(mb) if needs.values else None
    if mb.is_empty:  # keeps this rank's collectives in step with the others; contributes nothing
        if not backward:
            return False
        dummy = logits.sum() * 0.0
        if values is not None:
            dummy = dummy + values.sum() * 0.0
        dummy.backward()
        return True
    if scored is None:
        scored = token_logprobs(
            logits, mb.targets, temperature, with_entropy=True, entropy_grad=entropy_grad, mask_ids=mb.mask_ids
        )
    logprobs, entropy = scored
    if ctx.exact_logprobs is not None:
        exact = torch.cat([ctx.exact_logprobs[i] for i in mb.indices])
        logprobs = with_exact_values(logprobs, exact)
    device = ctx.device
    mask = batch.token_field("loss_mask", mb.indices, device)
    assert mask is not None
    fields = {name: batch.token_field(name, mb.indices, device) for name in TOKEN_FIELDS[1:]}
    teacher_topk = student_topk = None
    if topk > 0:  # the student's logprobs at the teacher's top-k ids, response positions only
        topk_ids, teacher_topk = batch.teacher_topk_rows(mb.indices, topk, device)
        student_topk = topk_logprobs(logits, topk_ids, temperature)
    inputs = LossInputs(
        logprobs=logprobs,
        loss_mask=mask,
        response_lengths=mb.response_lengths,
        entropy=entropy,
        values=values,
        teacher_topk_logprobs=teacher_topk,
        student_topk_logprobs=student_topk,
        **fields,
    )
    output = algorithm.loss(inputs)
    loss = aggregate_loss(output.per_token_loss, mask, mb.response_lengths, algorithm.aggregation, denominators)
    if backward:
        loss.backward()
    sums.add_loss(loss)
    for name, per_token in output.metrics.items():
        sums.add(name, per_token, mask)
    assert entropy is not None
    sums.add("entropy", entropy, mask)
    if fields["rollout_logprobs"] is not None:
        sums.add("train_rollout_logprob_abs_diff", (logprobs.detach() - fields["rollout_logprobs"]).abs(), mask)
    return backward
