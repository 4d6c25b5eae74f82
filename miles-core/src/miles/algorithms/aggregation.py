"""Loss aggregation that is exact under any micro-batching and any number of data-parallel ranks.

A trainer splits a step's sequences into micro-batches (and ranks). Each micro-batch contributes
:func:`aggregate_loss` with the *step-wide* denominators, and the contributions are summed (gradient
accumulation, then a SUM all-reduce over ranks). The total equals the loss over the whole step computed
at once, whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from miles.algorithms.base import Aggregation

__all__ = ["StepDenominators", "aggregate_loss", "masked_token_mean"]


@dataclass(frozen=True)
class StepDenominators:
    """Counts over the whole optimizer step (all micro-batches, all ranks)."""

    num_tokens: int
    """Trained tokens (``loss_mask`` sum)."""
    num_sequences: int
    """Sequences."""
    seq_len_norm: float = 1.0
    """The constant of ``seq_mean_token_sum_norm`` (Dr.GRPO: the maximum response length)."""


def aggregate_loss(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: list[int],
    mode: Aggregation,
    denominators: StepDenominators,
) -> torch.Tensor:
    """This micro-batch's share of the step loss (a scalar).

    :param per_token: ``[T]`` per-token losses of the micro-batch's response tokens, concatenated.
    :param loss_mask: ``[T]`` 1 for trained tokens.
    :param response_lengths: tokens per sequence (sums to ``T``).
    """
    import torch

    mask = loss_mask.to(per_token.dtype)
    masked = per_token * mask
    if mode == "token_mean":
        return masked.sum() / max(denominators.num_tokens, 1)
    per_seq = torch.split(masked, response_lengths)
    if mode == "seq_mean_token_mean":
        mask_per_seq = torch.split(mask, response_lengths)
        terms = [s.sum() / m.sum().clamp(min=1.0) for s, m in zip(per_seq, mask_per_seq, strict=True)]
    elif mode == "seq_mean_token_sum_norm":
        terms = [s.sum() / denominators.seq_len_norm for s in per_seq]
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    if not terms:
        return per_token.sum() * 0.0
    return torch.stack(terms).sum() / max(denominators.num_sequences, 1)


def masked_token_mean(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over trained tokens (0 when there are none)."""
    mask = loss_mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)
