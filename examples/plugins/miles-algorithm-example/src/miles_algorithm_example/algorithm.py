"""``median_grpo``: GRPO with a median baseline and a penalty on the importance ratio's drift from 1.

Miles' built-in algorithms are each a settings model and three choices from registries (see
:mod:`miles.algorithms.policy`): an advantage estimator, a policy surrogate and the loss terms added to it.
This module adds one estimator and one term, then composes them with the PPO-clip surrogate. Importing
it registers both; torch is imported inside the functions only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from miles.algorithms.advantages import broadcast_to_tokens, over_scored
from miles.algorithms.base import AdvantageInputs, Advantages, LossInputs
from miles.algorithms.estimators import estimator
from miles.algorithms.policy import PolicyGradientAlgorithm
from miles.algorithms.settings import GRPOSettings
from miles.algorithms.terms import term

if TYPE_CHECKING:
    import torch

__all__ = ["MedianGRPO", "MedianGRPOSettings", "drift_term", "group_median"]


# --8<-- [start:estimator]
@estimator("group_median")
def group_median(inputs: AdvantageInputs, settings: Any, rewards: list[list[float]]) -> Advantages:
    """Each sample's reward minus its group's median, on every trained token (0 on tool tokens).

    ``rewards`` are the group's rewards after the algorithm's reward shaping; a median baseline is not
    pulled around by one outlier reward the way GRPO's mean is. A failed sample has no reward (0 in
    ``rewards``): ``over_scored`` takes the median of the scored samples alone and gives it 0.
    """
    import statistics

    def minus_median(scores: list[float]) -> list[float]:
        median = statistics.median(scores)
        return [r - median for r in scores]

    advantages = []
    for group, scores in zip(inputs.groups, rewards, strict=True):
        values = over_scored(scores, group.scored, minus_median)
        advantages.append([broadcast_to_tokens(a, s.loss_mask) for s, a in zip(group.samples, values, strict=True)])
    return Advantages(advantages)


# --8<-- [end:estimator]


# --8<-- [start:term]
@term("drift")
def drift_term(inputs: LossInputs, settings: Any, name: str) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """``drift_coef * (ratio - 1)^2`` per token, ``ratio = pi / pi_old``: a smooth pull back towards the
    policy that sampled, on top of the clipped surrogate (the ``drift`` metric is logged either way)."""
    if inputs.old_logprobs is None:
        raise ValueError(f"algorithm {name!r}: LossInputs.old_logprobs is required (the drift term)")
    drift = (inputs.logprobs - inputs.old_logprobs).exp().sub(1.0).square()
    loss = settings.drift_coef * drift if settings.drift_coef > 0.0 else None
    return loss, {"drift": drift.detach()}


# --8<-- [end:term]


# --8<-- [start:algorithm]
class MedianGRPOSettings(GRPOSettings):
    """Settings of ``median_grpo``: GRPO's, plus the drift term's weight."""

    drift_coef: float = Field(0.1, ge=0.0)
    """Weight of the drift term ``(pi / pi_old - 1)^2``; 0 turns it off (the ``drift`` metric stays)."""


class MedianGRPO(PolicyGradientAlgorithm[MedianGRPOSettings]):
    """GRPO with a median baseline (``group_median``) and a penalty on the ratio's drift (``drift``)."""

    name = "median_grpo"
    estimator = "group_median"
    terms = (*PolicyGradientAlgorithm.terms, "drift")


# --8<-- [end:algorithm]
