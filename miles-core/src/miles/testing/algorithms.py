"""Reference algorithms for testing trainer backends: small, exact, with every loss input spelled out.

A trainer backend (FSDP, Megatron, a third party's) is checked by training the same batches with the
same algorithm as another backend (or an unsharded reference) and comparing losses, gradient norms and
weights; these algorithms make that comparison depend on the trainer alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from miles.algorithms.base import (
    AdvantageInputs,
    Advantages,
    Aggregation,
    Algorithm,
    AlgorithmNeeds,
    LossInputs,
    LossOutput,
)
from miles.components import ComponentSettings

if TYPE_CHECKING:
    import torch

__all__ = ["RatioPG", "RatioPGSettings", "RatioPGWithCritic"]


class RatioPGSettings(ComponentSettings):
    """Settings of :class:`RatioPG`."""

    aggregation: Aggregation = "token_mean"
    """How per-token losses become the step loss."""
    seq_len_norm: float = Field(1.0, gt=0.0)
    """The constant of ``seq_mean_token_sum_norm`` aggregation."""


class RatioPG(Algorithm[RatioPGSettings]):
    """``loss = -advantage * exp(logprob - old_logprob)`` (importance-weighted policy gradient); the
    advantage of a sample is its reward minus its group's mean, on every response token."""

    name = "ratio_pg"

    def __init__(self, settings: RatioPGSettings | None = None) -> None:
        super().__init__(settings if settings is not None else RatioPGSettings())

    @property
    def aggregation(self) -> Aggregation:
        return self.settings.aggregation

    @property
    def seq_len_norm(self) -> float:
        return self.settings.seq_len_norm

    def compute_advantages(self, inputs: AdvantageInputs) -> Advantages:
        import torch

        return Advantages(
            [
                [
                    torch.full((s.response_length,), r - sum(g.rewards) / len(g))
                    for s, r in zip(g.samples, g.rewards, strict=True)
                ]
                for g in inputs.groups
            ]
        )

    def loss(self, inputs: LossInputs) -> LossOutput:
        import torch

        if inputs.advantages is None or inputs.old_logprobs is None:
            raise ValueError("ratio_pg needs LossInputs.advantages and old_logprobs")
        ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
        return LossOutput(per_token_loss=-inputs.advantages * ratio, metrics={"ratio": ratio.detach()})


class RatioPGWithCritic(RatioPG):
    """:class:`RatioPG` plus a critic's ``(value - return)^2`` (exercises a trainer's value head)."""

    name = "ratio_pg_critic"

    @property
    def needs(self) -> AlgorithmNeeds:
        return AlgorithmNeeds(values=True)

    def loss(self, inputs: LossInputs) -> LossOutput:
        out = super().loss(inputs)
        if inputs.values is None or inputs.returns is None:
            raise ValueError("ratio_pg_critic needs LossInputs.values and returns")
        value_loss: torch.Tensor = (inputs.values - inputs.returns) ** 2
        return LossOutput(per_token_loss=out.per_token_loss + value_loss, metrics={"value_loss": value_loss.detach()})
