"""Forward (and backward) passes through Megatron's pipeline schedule, and one optimizer step.

The same code runs at every layout: ``get_forward_backward_func`` is the no-pipelining loop for one
stage and 1F1B for several; the loss function runs on the last stage with the logits gathered over
tensor parallel (vocabulary padding cut off), so the per-token math is the one of miles-fsdp.

Exactness across micro-batches and ranks: trained-token and sequence counts of the whole step are
all-reduced first (:class:`~miles.algorithms.aggregation.StepDenominators`); each micro-batch contributes
:func:`~miles.algorithms.aggregation.aggregate_loss` and back-propagates it; Megatron DDP *sums* the
gradients over data parallel (``calculate_per_token_loss``). The gradient equals that of the loss over
the whole batch in one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from miles.algorithms.aggregation import StepDenominators, aggregate_loss
from miles.algorithms.base import LossInputs
from miles.training.batch import TOKEN_FIELDS
from miles.training.comm import all_gather_json
from miles.training.logprobs import token_logprobs, topk_logprobs
from miles_megatron.microbatch import MicroBatch

if TYPE_CHECKING:
    from miles.algorithms.base import Algorithm
    from miles.training.batch import TrainBatch
    from miles_megatron.model import ModelParts

__all__ = ["StepTrainer", "lr_factor", "run_micro_batches", "run_train_step"]


class StepTrainer(Protocol):
    """What one optimizer step needs from the trainer."""

    step: int
    optimizer: Any

    @property
    def device(self) -> torch.device: ...

    @property
    def reports_metrics(self) -> bool: ...

    def model_parts(self) -> ModelParts: ...

    def data_parallel_batch(self, own: TrainBatch) -> TrainBatch: ...

    def micro_batches(self, batch: TrainBatch) -> list[MicroBatch]: ...

    def lr_at(self, step: int) -> float: ...


OnLogits = Callable[[MicroBatch, torch.Tensor], torch.Tensor]
"""Called on the last stage with a micro-batch and its ``[T, V]`` response logits; returns the loss."""


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, lr: float, min_lr: float) -> float:
    """Multiplier of the peak ``lr`` at optimizer step ``step`` (0-based), as miles-fsdp's schedule:
    linear warm-up to 1 over ``warmup_steps``, then constant / cosine / linear to ``min_lr / lr``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    floor = min_lr / lr
    progress = min(max(step - warmup_steps, 0) / max(total_steps - warmup_steps, 1), 1.0)
    if schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    raise ValueError(f"train.lr_schedule: unknown schedule {schedule!r} (expected constant, cosine or linear)")


def run_micro_batches(
    module: Any, micro_batches: Sequence[MicroBatch], on_logits: OnLogits, *, vocab_size: int, forward_only: bool
) -> None:
    """Run every micro-batch through the schedule (forward, and backward unless ``forward_only``)."""
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(output)[..., :vocab_size]
        loss = logits.sum() * 0.0 if mb.is_empty else on_logits(mb, logits[mb.rows, mb.cols])
        return loss, torch.ones((), dtype=torch.int), {}

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        output = model(mb.input_ids, mb.position_ids, None)
        return output, partial(loss_func, mb)

    widths = [int(mb.input_ids.shape[1]) for mb in micro_batches]
    rows = [int(mb.input_ids.shape[0]) for mb in micro_batches]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[module],
        num_microbatches=len(micro_batches),
        seq_length=max(widths),
        micro_batch_size=max(rows),
        forward_only=forward_only,
    )


def _all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def _agreed_names(local: set[str]) -> list[str]:
    return sorted({n for names in all_gather_json(sorted(local)) for n in names})


def run_train_step(
    trainer: StepTrainer, own: TrainBatch, algorithm: Algorithm, *, temperature: float
) -> dict[str, float]:
    """One optimizer step; ``own`` is this rank's share as the driver gave it. Returns metrics reduced
    over ranks."""
    from megatron.core.distributed import finalize_model_grads

    if own.advantages is None and algorithm.needs.rollout:
        raise ValueError(f"algorithm {algorithm.name!r}: TrainBatch.advantages is None; compute advantages first")
    if algorithm.needs.values:
        raise TypeError(f"algorithm {algorithm.name!r} needs a critic; the megatron trainer has no value head yet")
    device = trainer.device
    topk = getattr(algorithm.needs, "teacher_topk", 0)
    counts = torch.tensor(
        [float(own.loss_mask.sum()), float(len(own)), float(own.num_tokens)],
        dtype=torch.float64,
        device=device,
    )
    _all_reduce_sum(counts)  # every rank's own share is distinct: the sums are the step's
    denominators = StepDenominators(
        num_tokens=int(counts[0].item()), num_sequences=int(counts[1].item()), seq_len_norm=algorithm.seq_len_norm
    )
    batch = trainer.data_parallel_batch(own)
    reports = trainer.reports_metrics
    loss_sum = torch.zeros((), dtype=torch.float64)
    sums: dict[str, torch.Tensor] = {}

    def add(name: str, per_token: torch.Tensor, mask: torch.Tensor) -> None:
        if reports:
            value = (per_token.detach().double() * mask.double()).sum().cpu()
            sums[name] = sums.get(name, torch.zeros((), dtype=torch.float64)) + value

    def on_logits(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        nonlocal loss_sum
        logprobs, entropy = token_logprobs(
            logits, mb.targets, temperature, with_entropy=True, entropy_grad=getattr(algorithm.needs, "entropy", False)
        )
        mask = batch.token_field("loss_mask", mb.indices, device)
        assert mask is not None and entropy is not None
        fields = {name: batch.token_field(name, mb.indices, device) for name in TOKEN_FIELDS[1:]}
        teacher_topk = student_topk = None
        if topk > 0:
            ids, teacher_topk = batch.teacher_topk_rows(mb.indices, topk, device)
            student_topk = topk_logprobs(logits, ids, temperature)
        inputs = LossInputs(
            logprobs=logprobs,
            loss_mask=mask,
            response_lengths=mb.response_lengths,
            entropy=entropy,
            teacher_topk_logprobs=teacher_topk,
            student_topk_logprobs=student_topk,
            **fields,
        )
        output = algorithm.loss(inputs)
        loss = aggregate_loss(output.per_token_loss, mask, mb.response_lengths, algorithm.aggregation, denominators)
        if reports:
            loss_sum = loss_sum + loss.detach().double().cpu()
        for name, per_token in output.metrics.items():
            add(name, per_token, mask)
        add("entropy", entropy, mask)
        if fields["rollout_logprobs"] is not None:
            add("train_rollout_logprob_abs_diff", (logprobs.detach() - fields["rollout_logprobs"]).abs(), mask)
        return loss

    actor = trainer.model_parts()
    module, optimizer = actor.module, trainer.optimizer
    module.train()
    module.zero_grad_buffer()
    optimizer.zero_grad()
    run_micro_batches(module, trainer.micro_batches(batch), on_logits, vocab_size=actor.vocab_size, forward_only=False)
    finalize_model_grads([module])
    lr = trainer.lr_at(trainer.step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    _, grad_norm, _ = optimizer.step()

    names = _agreed_names(set(sums))
    zero = torch.zeros((), dtype=torch.float64)
    reduced = _all_reduce_sum(torch.stack([loss_sum, *[sums.get(n, zero) for n in names]]).to(device))
    metrics = {"loss": float(reduced[0].item()), "grad_norm": float(grad_norm or 0.0), "lr": lr}
    for i, name in enumerate(names):
        metrics[name] = float(reduced[i + 1].item()) / max(denominators.num_tokens, 1)
    metrics["tokens"] = float(counts[2].item())
    metrics["trained_tokens"] = float(denominators.num_tokens)
    metrics["sequences"] = float(denominators.num_sequences)
    return metrics
