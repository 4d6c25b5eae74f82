"""PPO with a critic: GAE advantages (gamma, lambda), PPO-clip policy loss and a clipped value loss."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel

from miles.algorithms.advantages import gae, global_token_normalize
from miles.algorithms.base import LossInputs, LossOutput
from miles.algorithms.policy import PolicyGradientAlgorithm, require
from miles.algorithms.reinforce import token_rewards_with_kl
from miles.algorithms.settings import PPOSettings

if TYPE_CHECKING:
    import torch

    from miles.types import Sample, SampleGroup

__all__ = ["PPO"]


class PPO(PolicyGradientAlgorithm):
    """PPO: GAE from the critic's values, PPO-clip loss plus ``value_coef`` times the clipped value loss."""

    name = "ppo"
    Settings: ClassVar[type[BaseModel]] = PPOSettings
    has_critic = True
    supports_kl_in_reward = True

    def _gae(
        self,
        groups: Sequence[SampleGroup],
        values: Sequence[Sequence[torch.Tensor]] | None,
        ref_logprobs: Sequence[Sequence[torch.Tensor]] | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        import torch

        s = self.settings
        assert isinstance(s, PPOSettings)
        if values is None:
            raise ValueError("algorithm 'ppo': compute_advantages needs the critic's values (needs.values)")
        advs, rets, masks = [], [], []
        for g, group in enumerate(groups):
            for i, (sample, reward) in enumerate(zip(group.samples, self.shaped_rewards(group), strict=True)):
                ref = ref_logprobs[g][i] if ref_logprobs is not None else None
                mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
                token_rewards = _token_rewards(sample, ref, s, reward)
                adv, ret = gae(token_rewards, values[g][i], mask, gamma=s.gamma, lam=s.lam)
                advs.append(adv)
                rets.append(ret)
                masks.append(mask)
        return advs, rets, masks

    def compute_advantages(
        self,
        groups: Sequence[SampleGroup],
        values: Sequence[Sequence[torch.Tensor]] | None = None,
        *,
        ref_logprobs: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> list[list[torch.Tensor]]:
        s = self.settings
        assert isinstance(s, PPOSettings)
        advs, _, masks = self._gae(groups, values, ref_logprobs)
        if s.normalize_advantages:
            advs = global_token_normalize(advs, masks, eps=s.eps)
        return _regroup(groups, advs)

    def compute_returns(
        self,
        groups: Sequence[SampleGroup],
        values: Sequence[Sequence[torch.Tensor]] | None = None,
        *,
        ref_logprobs: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> list[list[torch.Tensor]]:
        _, rets, _ = self._gae(groups, values, ref_logprobs)
        return _regroup(groups, rets)

    def loss(self, inputs: LossInputs) -> LossOutput:
        from miles.algorithms.losses import value_loss

        s = self.settings
        assert isinstance(s, PPOSettings)
        out = super().loss(inputs)
        if s.value_coef > 0.0 and inputs.values is not None:
            returns = require(inputs.returns, "returns", self.name, "the value loss")
            old_values = inputs.old_values if inputs.old_values is not None else inputs.values.detach()
            vloss, vmetrics = value_loss(inputs.values, old_values, returns, clip=s.value_clip)
            out.per_token_loss = out.per_token_loss + s.value_coef * vloss
            out.metrics["value_loss"] = vloss.detach()
            out.metrics.update(vmetrics)
        return out


def _token_rewards(sample: Sample, ref: torch.Tensor | None, settings: PPOSettings, reward: float) -> torch.Tensor:
    """Per-token rewards for GAE: ``reward`` on the last trained token, ``-kl_coef * KL_t`` when in the reward."""
    import torch

    mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
    rewards = torch.zeros(len(sample.loss_mask), dtype=torch.float32)
    if settings.kl_in_reward and settings.kl_coef > 0.0:
        # gamma = 0 turns the KL-penalised returns into the per-token rewards themselves.
        return token_rewards_with_kl(sample, ref, settings, reward, gamma=0.0)
    idx = torch.nonzero(mask > 0).flatten()
    if idx.numel():
        rewards[idx[-1]] = reward
    return rewards


def _regroup(groups: Sequence[SampleGroup], flat: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    it = iter(flat)
    return [[next(it) for _ in group.samples] for group in groups]
