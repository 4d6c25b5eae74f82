"""Group-relative algorithms: GRPO, Dr.GRPO, DAPO, GSPO and RLOO.

Each sample's scalar advantage comes from the rewards of its own group (the samples of one prompt) and
is spread over the sample's trained tokens.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel

from miles.algorithms.advantages import broadcast_to_tokens, group_normalized, rloo
from miles.algorithms.losses import KLEstimator, kl_estimate
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

    from miles.types import Sample, SampleGroup

__all__ = ["DAPO", "GRPO", "GSPO", "RLOO", "DrGRPO", "GroupAlgorithm"]


class GroupAlgorithm(PolicyGradientAlgorithm):
    """A policy-gradient algorithm whose advantages are a function of each group's rewards.

    With ``kl_in_reward`` each sample's reward is lowered by ``kl_coef`` times its summed per-token KL
    (rollout policy vs reference, over trained tokens) before the group estimator runs.
    """

    supports_kl_in_reward = True

    @abstractmethod
    def group_advantages(self, rewards: list[float]) -> list[float]:
        """One advantage per sample of a group, from the group's rewards."""

    def compute_advantages(
        self,
        groups: Sequence[SampleGroup],
        values: Sequence[Sequence[torch.Tensor]] | None = None,
        *,
        ref_logprobs: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> list[list[torch.Tensor]]:
        out = []
        kl_in_reward = self.s.kl_in_reward and self.s.kl_coef > 0.0
        if kl_in_reward and ref_logprobs is None:
            raise ValueError(f"algorithm {self.name!r}: kl_in_reward needs ref_logprobs in compute_advantages")
        for g, group in enumerate(groups):
            rewards = self.shaped_rewards(group)
            if kl_in_reward:
                assert ref_logprobs is not None
                rewards = [
                    r - self.s.kl_coef * _sequence_kl(sample, ref_logprobs[g][i], self.s.kl_estimator)
                    for i, (r, sample) in enumerate(zip(rewards, group.samples, strict=True))
                ]
            scalars = self.group_advantages(rewards)
            out.append([broadcast_to_tokens(a, s.loss_mask) for a, s in zip(scalars, group.samples, strict=True)])
        return out


def _sequence_kl(sample: Sample, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> float:
    """Summed per-token KL estimate of ``sample`` between its rollout logprobs and ``ref_logprobs``."""
    import torch

    rollout = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
    mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
    return float((kl_estimate(rollout, ref_logprobs.to(torch.float32), estimator) * mask).sum())


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
