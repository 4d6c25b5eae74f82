"""What every trainer's optimizer step reduces over its ranks: the step's counts, which are the loss's
denominators (:class:`~miles.algorithms.aggregation.StepDenominators`), and its metrics.

The counts are all-reduced before the first micro-batch (each rank's share of the step is distinct, so
the sums are the step's); the metrics are summed in float64 as micro-batches go (the loss, and each
per-token metric masked by the loss mask) and reduced once at the end: a metric's value is its masked
sum over the step divided by the step's trained tokens. Metric names agree over the ranks through JSON
(a rank whose micro-batches were all empty saw none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.algorithms.aggregation import StepDenominators
from miles.training.comm import all_gather_json, all_reduce_sum

if TYPE_CHECKING:
    import torch

__all__ = ["StepCounts", "StepMetrics", "count_step"]


@dataclass(frozen=True)
class StepCounts:
    """One optimizer step's counts over every rank."""

    denominators: StepDenominators
    """Trained tokens and sequences: the loss's denominators."""
    tokens: float
    """Tokens of the step (what each rank passed as ``tokens``, summed)."""


def count_step(
    loss_mask: torch.Tensor, sequences: int, tokens: int, *, seq_len_norm: float, device: torch.device
) -> StepCounts:
    """This rank's trained tokens (``loss_mask``'s sum), ``sequences`` and ``tokens``, summed over the ranks
    (a collective: every rank calls it)."""
    import torch

    counts = torch.tensor([float(loss_mask.sum()), float(sequences), float(tokens)], dtype=torch.float64, device=device)
    all_reduce_sum(counts)
    denominators = StepDenominators(
        num_tokens=int(counts[0].item()), num_sequences=int(counts[1].item()), seq_len_norm=seq_len_norm
    )
    return StepCounts(denominators, float(counts[2].item()))


class StepMetrics:
    """The sums one step's metrics are reduced from, kept in float64 on ``device`` as micro-batches go.

    :param record: ``False`` keeps nothing (a rank whose sums are not the step's, e.g. a pipeline stage
        without the loss); :meth:`reduce` is still a collective and must be called on every rank.
    """

    def __init__(self, device: torch.device, *, record: bool = True) -> None:
        import torch

        self.device = device
        self.record = record
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        """This rank's share of the step loss, summed over its micro-batches."""
        self._sums: dict[str, torch.Tensor] = {}

    def _zero(self) -> torch.Tensor:
        import torch

        return torch.zeros((), dtype=torch.float64, device=self.device)

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's (scalar) share of the loss."""
        if self.record:
            self.loss = self.loss + loss.detach().double().to(self.device)

    def add(self, name: str, per_token: torch.Tensor, mask: torch.Tensor) -> None:
        """Add the masked sum of a per-token metric (``[T]``) of a micro-batch."""
        if self.record:
            value = (per_token.detach().double() * mask.double()).sum().to(self.device)
            self._sums[name] = self._sums.get(name, self._zero()) + value

    def reduce(self, num_tokens: int, device: torch.device) -> dict[str, float]:
        """``{"loss": the step loss, name: masked sum / num_tokens ...}`` over every rank (a collective; the
        reduction runs on ``device``, the process group's)."""
        import torch

        names = sorted({name for part in all_gather_json(sorted(self._sums)) for name in part})
        zero = self._zero()
        stacked = torch.stack([self.loss, *[self._sums.get(name, zero) for name in names]])
        reduced = all_reduce_sum(stacked.to(device))
        metrics = {"loss": float(reduced[0].item())}
        for i, name in enumerate(names):
            metrics[name] = float(reduced[i + 1].item()) / max(num_tokens, 1)
        return metrics
