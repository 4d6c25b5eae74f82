"""A step's counts and metrics in one process (the two-rank reduction is in ``test_comm.py``)."""

from __future__ import annotations

import torch

from miles.training.step_metrics import StepMetrics, count_step

CPU = torch.device("cpu")


def test_counts_are_the_step_denominators() -> None:
    counts = count_step(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, 11, seq_len_norm=8.0, device=CPU)
    assert (counts.denominators.num_tokens, counts.denominators.num_sequences) == (3, 2)
    assert counts.denominators.seq_len_norm == 8.0 and counts.tokens == 11.0


def test_metrics_are_masked_sums_over_the_trained_tokens() -> None:
    sums = StepMetrics(CPU)
    mask = torch.tensor([1.0, 1.0, 0.0])
    sums.add_loss(torch.tensor(0.25, requires_grad=True))
    sums.add_loss(torch.tensor(0.5))
    sums.add("kl", torch.tensor([0.5, 1.5, 100.0]), mask)
    sums.add("kl", torch.tensor([1.0, 1.0, 1.0]), mask)
    assert sums.reduce(4, CPU) == {"loss": 0.75, "kl": 1.0}
    assert sums.loss.dtype == torch.float64 and not sums.loss.requires_grad


def test_a_rank_that_records_nothing_reduces_zeros() -> None:
    sums = StepMetrics(CPU, record=False)
    sums.add_loss(torch.tensor(3.0))
    sums.add("kl", torch.ones(2), torch.ones(2))
    assert sums.reduce(2, CPU) == {"loss": 0.0}
