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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch

from miles.algorithms.aggregation import aggregate_loss
from miles.algorithms.base import LossInputs, LossOutput
from miles.training.batch import TOKEN_FIELDS
from miles.training.comm import all_reduce_sum
from miles.training.guards import refuse_non_finite
from miles.training.logprobs import token_logprobs, topk_logprobs
from miles.training.step_metrics import StepMetrics, count_step
from miles_megatron.microbatch import MicroBatch

if TYPE_CHECKING:
    from miles.algorithms.base import Algorithm
    from miles.training.batch import TrainBatch
    from miles.training.routing import RouterReplay
    from miles_megatron.model import ModelParts

__all__ = ["StepTrainer", "forward_per_token", "run_micro_batches", "run_train_step"]


class StepTrainer(Protocol):
    """What one optimizer step needs from the trainer."""

    step: int
    critic_step: int
    optimizer: Any
    critic_optimizer: Any
    """The critic's optimizer (``None`` without a critic)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def reports_metrics(self) -> bool: ...

    def model_parts(self) -> ModelParts: ...

    def critic_parts(self) -> ModelParts | None: ...

    def data_parallel_batch(self, own: TrainBatch) -> TrainBatch: ...

    def micro_batches(self, batch: TrainBatch) -> list[MicroBatch]: ...

    def lr_at(self, step: int, *, critic: bool = False) -> float: ...


OnOutput = Callable[[MicroBatch, torch.Tensor], torch.Tensor]
"""Called on the last stage with a micro-batch and the model's output at its response positions (``[T, V]``
logits, or ``[T]`` values for the critic); returns the loss."""


def run_micro_batches(
    module: Any,
    micro_batches: Sequence[MicroBatch],
    on_output: OnOutput,
    *,
    vocab_size: int | None,
    forward_only: bool,
    routing: RouterReplay | None = None,
) -> None:
    """Run every micro-batch through the schedule (forward, and backward unless ``forward_only``).

    ``vocab_size`` is the HF vocabulary of a policy (its logits are gathered over tensor parallel and the
    padding cut off); ``None`` for the critic, whose value head gives one value per position. ``routing``
    (the actor's, :mod:`miles_megatron.routing`) gets each micro-batch's engine experts before its forward.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from miles_megatron.routing import router_rows

    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    sequence_parallel = bool(getattr(module.config, "sequence_parallel", False))

    def loss_func(mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        if vocab_size is None:
            out = output[..., 0]  # [b, s] values
        else:
            out = tensor_parallel.gather_from_tensor_model_parallel_region(output)[..., :vocab_size]
        loss = out.sum() * 0.0 if mb.is_empty else on_output(mb, out[mb.rows, mb.cols])
        return loss, torch.ones((), dtype=torch.int), {}

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        if routing is not None:
            routing.set_rows(router_rows(mb, tp_rank=tp_rank, tp_size=tp_size, sequence_parallel=sequence_parallel))
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


PerToken = Callable[[MicroBatch, torch.Tensor], dict[str, torch.Tensor]]
"""Per-token results (``[T]`` each, by name) of a micro-batch from the model's output at its response
positions."""


def forward_per_token(
    parts: ModelParts,
    batch: TrainBatch,
    micro_batches: Sequence[MicroBatch],
    compute: PerToken,
    names: Sequence[str],
    *,
    values: bool = False,
) -> dict[str, torch.Tensor]:
    """A forward-only pass; each named result as one ``[R]`` float32 tensor of ``batch``'s response tokens
    (filled on the last pipeline stage, zeros elsewhere). ``values``: ``parts`` is the critic."""
    offsets = batch.response_offsets
    filled = {name: torch.zeros(batch.num_response_tokens, dtype=torch.float32) for name in names}

    def on_output(mb: MicroBatch, out: torch.Tensor) -> torch.Tensor:
        for name, result in compute(mb, out).items():
            for i, part in zip(mb.indices, result.split(mb.response_lengths), strict=True):
                filled[name][offsets[i] : offsets[i + 1]] = part.detach().float().cpu()
        return out.sum() * 0.0

    module = parts.module
    was_training = module.training
    module.eval()
    with torch.no_grad():
        vocab = None if values else parts.vocab_size
        run_micro_batches(module, micro_batches, on_output, vocab_size=vocab, forward_only=True, routing=parts.routing)
    module.train(was_training)
    return filled


@dataclass
class _ActorTerms:
    """The policy's side of one micro-batch's loss inputs, kept (detached) for the critic's pass."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    student_topk: torch.Tensor | None


def _check_inputs(batch: TrainBatch, algorithm: Algorithm, *, has_critic: bool) -> int:
    """Clear errors for what the algorithm needs and the batch or the trainer lacks; the top-k it needs."""
    if batch.advantages is None and algorithm.needs.rollout:
        raise ValueError(f"algorithm {algorithm.name!r}: TrainBatch.advantages is None; compute advantages first")
    topk = algorithm.needs.teacher_topk
    if topk > 0 and (batch.teacher_topk_ids is None or batch.teacher_topk < topk):
        have = "none" if batch.teacher_topk_ids is None else f"top-{batch.teacher_topk}"
        raise ValueError(
            f"algorithm {algorithm.name!r} needs the teacher's top-{topk} per response token, the batch has {have}: "
            "score the samples with a teacher ([rollout.teacher] url, top_k >= the algorithm's distill_topk)"
        )
    if algorithm.needs.values and not has_critic:
        raise RuntimeError(f"algorithm {algorithm.name!r} needs values: call setup(need_values=True)")
    return topk


def run_train_step(
    trainer: StepTrainer, own: TrainBatch, algorithm: Algorithm, *, temperature: float
) -> dict[str, float]:
    """One optimizer step; ``own`` is this rank's share as the driver gave it. Returns metrics reduced
    over ranks.

    With a critic the loss couples two models that Megatron's schedule runs one at a time, so the step
    runs three passes over the same micro-batches: the critic's values without gradient, the policy's
    pass (the loss with those values fixed: the policy's gradient), and the critic's pass (the loss with
    the policy's logprobs fixed: the critic's gradient). Each model gets the partial derivative of the
    one loss, as one backward through both would give it.
    """
    from megatron.core.distributed import finalize_model_grads

    device = trainer.device
    critic = trainer.critic_parts() if algorithm.needs.values else None
    topk = _check_inputs(own, algorithm, has_critic=critic is not None)
    # every rank's own share is distinct: the sums are the step's
    counts = count_step(own.loss_mask, len(own), own.num_tokens, seq_len_norm=algorithm.seq_len_norm, device=device)
    denominators = counts.denominators
    batch = trainer.data_parallel_batch(own)
    micro_batches = trainer.micro_batches(batch)
    sums = StepMetrics(torch.device("cpu"), record=trainer.reports_metrics)
    fixed_values: torch.Tensor | None = None
    if critic is not None:
        fixed_values = forward_per_token(
            critic, batch, micro_batches, lambda mb, out: {"values": out}, ["values"], values=True
        )["values"]
    kept: dict[tuple[int, ...], _ActorTerms] = {}

    def loss_of(mb: MicroBatch, terms: _ActorTerms, values: torch.Tensor | None) -> tuple[torch.Tensor, LossOutput]:
        mask = batch.token_field("loss_mask", mb.indices, device)
        assert mask is not None
        fields = {name: batch.token_field(name, mb.indices, device) for name in TOKEN_FIELDS[1:]}
        teacher_topk = batch.teacher_topk_rows(mb.indices, topk, device)[1] if topk > 0 else None
        inputs = LossInputs(
            logprobs=terms.logprobs,
            loss_mask=mask,
            response_lengths=mb.response_lengths,
            entropy=terms.entropy,
            values=values,
            teacher_topk_logprobs=teacher_topk,
            student_topk_logprobs=terms.student_topk,
            **fields,
        )
        output = algorithm.loss(inputs)
        loss = aggregate_loss(output.per_token_loss, mask, mb.response_lengths, algorithm.aggregation, denominators)
        return loss, output

    def on_logits(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        logprobs, entropy = token_logprobs(
            logits,
            mb.targets,
            temperature,
            with_entropy=True,
            entropy_grad=algorithm.needs.entropy,
            mask_ids=mb.mask_ids,
        )
        assert entropy is not None
        student_topk = None
        if topk > 0:
            ids, _ = batch.teacher_topk_rows(mb.indices, topk, device)
            student_topk = topk_logprobs(logits, ids, temperature)
        terms = _ActorTerms(logprobs, entropy, student_topk)
        values = None
        if fixed_values is not None:
            values = fixed_values[batch.response_index(mb.indices)].to(device)
            kept[tuple(mb.indices)] = _ActorTerms(
                logprobs.detach(), entropy.detach(), None if student_topk is None else student_topk.detach()
            )
        loss, output = loss_of(mb, terms, values)
        mask = batch.token_field("loss_mask", mb.indices, device)
        assert mask is not None
        sums.add_loss(loss)
        for name, per_token in output.metrics.items():
            sums.add(name, per_token, mask)
        sums.add("entropy", entropy, mask)
        rollout = batch.token_field("rollout_logprobs", mb.indices, device)
        if rollout is not None:
            sums.add("train_rollout_logprob_abs_diff", (logprobs.detach() - rollout).abs(), mask)
        return loss

    def on_values(mb: MicroBatch, values: torch.Tensor) -> torch.Tensor:
        return loss_of(mb, kept.pop(tuple(mb.indices)), values)[0]

    actor = trainer.model_parts()
    trained = [(actor, trainer.optimizer, False)]
    if critic is not None:
        trained.append((critic, trainer.critic_optimizer, True))
    for parts, optimizer, _ in trained:
        parts.module.train()
        parts.module.zero_grad_buffer()
        optimizer.zero_grad()
    run_micro_batches(
        actor.module, micro_batches, on_logits, vocab_size=actor.vocab_size, forward_only=False, routing=actor.routing
    )
    if critic is not None:
        run_micro_batches(critic.module, micro_batches, on_values, vocab_size=None, forward_only=False)
    # the loss summed over every rank (pipeline stages without a loss add 0): a NaN anywhere refuses the step
    refuse_non_finite(trainer.step + 1, loss=float(all_reduce_sum(sums.loss.reshape(1).to(device).clone())[0].item()))
    metrics: dict[str, float] = {}
    for parts, optimizer, is_critic in trained:
        finalize_model_grads([parts.module])
        lr = trainer.lr_at(trainer.critic_step if is_critic else trainer.step, critic=is_critic)
        for group in optimizer.param_groups:
            group["lr"] = lr
        _, grad_norm, _ = optimizer.step()
        prefix = "critic_" if is_critic else ""
        metrics[f"{prefix}grad_norm"], metrics[f"{prefix}lr"] = float(grad_norm or 0.0), lr

    metrics.update(sums.reduce(denominators.num_tokens, device))
    metrics["tokens"] = counts.tokens
    metrics["trained_tokens"] = float(denominators.num_tokens)
    metrics["sequences"] = float(denominators.num_sequences)
    return metrics
