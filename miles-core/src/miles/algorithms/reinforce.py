"""REINFORCE++ and REINFORCE++-baseline (Hu et al. 2025): batch-level normalisation of returns.

``reinforce_pp``: the return of every trained token is the sample's reward (minus the discounted KL
penalties that follow it when ``kl_in_reward``), whitened over every trained token of the batch.
``reinforce_pp_baseline``: the group mean reward is subtracted first, then the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel

from miles.algorithms.advantages import broadcast_to_tokens, global_token_normalize, kl_penalized_returns
from miles.algorithms.losses import kl_estimate
from miles.algorithms.policy import PolicyGradientAlgorithm
from miles.algorithms.settings import PolicyLossSettings, ReinforcePPSettings

if TYPE_CHECKING:
    import torch

    from miles.types import Sample, SampleGroup

__all__ = ["ReinforcePP", "ReinforcePPBaseline", "token_rewards_with_kl"]


def token_rewards_with_kl(
    sample: Sample, ref_logprobs: torch.Tensor | None, settings: PolicyLossSettings, reward: float, gamma: float
) -> torch.Tensor:
    """Per-token returns of ``sample``: ``reward`` broadcast, or KL-penalised returns when the KL is in the reward.

    The KL is estimated between the rollout logprobs (the policy that sampled) and ``ref_logprobs``.
    """
    import torch

    s = settings
    if s.kl_in_reward and s.kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError(
                "kl_in_reward needs ref_logprobs in compute_advantages (needs.ref_logprobs_for_advantages)"
            )
        rollout = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
        kl = kl_estimate(rollout, ref_logprobs.to(torch.float32), s.kl_estimator)
        mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
        return kl_penalized_returns(reward, kl, mask, kl_coef=s.kl_coef, gamma=gamma)
    return broadcast_to_tokens(reward, sample.loss_mask)


class ReinforcePP(PolicyGradientAlgorithm):
    """REINFORCE++: returns whitened over the whole batch's trained tokens, PPO-clip loss."""

    name = "reinforce_pp"
    Settings: ClassVar[type[BaseModel]] = ReinforcePPSettings
    supports_kl_in_reward = True
    subtract_group_mean: ClassVar[bool] = False

    def compute_advantages(
        self,
        groups: Sequence[SampleGroup],
        values: Sequence[Sequence[torch.Tensor]] | None = None,
        *,
        ref_logprobs: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> list[list[torch.Tensor]]:
        import torch

        s = self.settings
        assert isinstance(s, ReinforcePPSettings)
        flat: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        for g, group in enumerate(groups):
            rewards = self.shaped_rewards(group)
            if self.subtract_group_mean and rewards:
                mean = sum(rewards) / len(rewards)
                rewards = [r - mean for r in rewards]
            for i, (sample, reward) in enumerate(zip(group.samples, rewards, strict=True)):
                ref = ref_logprobs[g][i] if ref_logprobs is not None else None
                flat.append(token_rewards_with_kl(sample, ref, s, reward, s.gamma))
                masks.append(torch.tensor(sample.loss_mask, dtype=torch.float32))
        normed = global_token_normalize(flat, masks, eps=s.eps)
        out: list[list[torch.Tensor]] = []
        it = iter(normed)
        for group in groups:
            out.append([next(it) for _ in group.samples])
        return out


class ReinforcePPBaseline(ReinforcePP):
    """REINFORCE++-baseline: group mean subtracted, then whitened over the batch's trained tokens."""

    name = "reinforce_pp_baseline"
    subtract_group_mean = True
