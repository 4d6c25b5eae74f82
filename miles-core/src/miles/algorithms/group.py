"""Group-relative algorithms: GRPO, Dr.GRPO, DAPO, GSPO and RLOO.

Each sample's scalar advantage comes from the rewards of its own group (the samples of one prompt) and
is spread over the sample's trained tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel

from miles.algorithms.advantages import broadcast_to_tokens, group_normalized, rloo
from miles.algorithms.policy import PolicyGradientAlgorithm
from miles.algorithms.settings import (
    DAPOSettings,
    DrGRPOSettings,
    GRPOSettings,
    GSPOSettings,
    RLOOSettings,
)

if TYPE_CHECKING:
    import torch

    from miles.types import SampleGroup

__all__ = ["DAPO", "GRPO", "GSPO", "RLOO", "DrGRPO", "GroupAlgorithm"]


class GroupAlgorithm(PolicyGradientAlgorithm):
    """A policy-gradient algorithm whose advantages are a function of each group's rewards."""

    def group_advantages(self, rewards: list[float]) -> list[float]:
        raise NotImplementedError

    def compute_advantages(
        self,
        groups: Sequence[SampleGroup],
        values: Sequence[Sequence[torch.Tensor]] | None = None,
        *,
        ref_logprobs: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> list[list[torch.Tensor]]:
        out = []
        for group in groups:
            scalars = self.group_advantages(self.shaped_rewards(group))
            out.append([broadcast_to_tokens(a, s.loss_mask) for a, s in zip(scalars, group.samples, strict=True)])
        return out


class GRPO(GroupAlgorithm):
    """GRPO: group-normalised advantages ``(r - mean) / (std + eps)`` with the PPO-clip loss."""

    name = "grpo"
    Settings: ClassVar[type[BaseModel]] = GRPOSettings

    def group_advantages(self, rewards: list[float]) -> list[float]:
        s = self.settings
        assert isinstance(s, GRPOSettings)
        return group_normalized(rewards, std_normalize=s.std_normalize, unbiased_std=s.unbiased_std, eps=s.eps)


class DrGRPO(GRPO):
    """Dr.GRPO: ``r - mean`` (no std), each sequence's token sum over ``max_response_length``."""

    name = "dr_grpo"
    Settings: ClassVar[type[BaseModel]] = DrGRPOSettings


class DAPO(GRPO):
    """DAPO: clip-higher (0.28), token-mean loss, dynamic sampling, optional overlong reward shaping."""

    name = "dapo"
    Settings: ClassVar[type[BaseModel]] = DAPOSettings


class GSPO(GRPO):
    """GSPO: group-normalised advantages with a clipped sequence-level (length-normalised) ratio."""

    name = "gspo"
    Settings: ClassVar[type[BaseModel]] = GSPOSettings
    sequence_ratio = True


class RLOO(GroupAlgorithm):
    """RLOO: leave-one-out baseline ``r_i - mean_{j != i} r_j`` with the PPO-clip loss."""

    name = "rloo"
    Settings: ClassVar[type[BaseModel]] = RLOOSettings

    def group_advantages(self, rewards: list[float]) -> list[float]:
        return rloo(rewards)
