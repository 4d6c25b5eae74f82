"""Flow-GRPO (Liu et al. 2025): GRPO over denoising trajectories.

Each group holds the images of one prompt. A sample's advantage is its reward normalised within its group,
clipped to ``[-adv_clip_max, adv_clip_max]`` and given to each of its SDE steps (its response "tokens").
The per-step loss is PPO's clipped surrogate of the step's ratio ``pi_theta / pi_old`` (Flow-GRPO's clip
range is tiny: log-probs are per-element means), plus ``kl_coef`` times the exact KL between the policy's
and the reference's step Gaussians, which the diffusion trainer computes from both transformers' means
(:class:`DiffusionLossInputs.kl`). Steps of all trajectories are averaged (``token_mean``), as Flow-GRPO
averages over the batch and the trained timesteps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import Field

from miles.algorithms.advantages import broadcast_to_tokens, group_normalized, over_scored
from miles.algorithms.base import (
    AdvantageInputs,
    Advantages,
    Aggregation,
    Algorithm,
    AlgorithmNeeds,
    LossInputs,
    LossOutput,
)
from miles.components import ComponentSettings, SettingsT

if TYPE_CHECKING:
    import torch

__all__ = ["DiffusionAlgorithm", "DiffusionLossInputs", "FlowGRPO", "FlowGRPOSettings"]


@dataclass
class DiffusionLossInputs(LossInputs):
    """:class:`~miles.algorithms.base.LossInputs` of denoising steps (one "token" per SDE step)."""

    kl: torch.Tensor | None = None
    """``[T]`` per step: KL(policy step || reference step), exact for the two Gaussians (per-element mean),
    differentiable through the policy; set when the algorithm's ``kl_coef`` is above 0."""


class DiffusionAlgorithm(Algorithm[SettingsT]):
    """An algorithm over denoising trajectories: what the diffusion trainer asks of it besides the loss."""

    @property
    def kl_coef(self) -> float:
        """Weight of the reference KL (above 0: the trainer loads the reference transformer)."""
        return 0.0


class FlowGRPOSettings(ComponentSettings):
    """Settings of ``flow_grpo`` (defaults: Flow-GRPO's SD3 recipe)."""

    clip_eps: float = Field(1e-4, gt=0.0)
    """Clip range of the per-step ratio (the ratio of per-element-mean log-probs moves little)."""
    adv_clip_max: float = Field(5.0, gt=0.0)
    """Advantages are clipped to ``[-adv_clip_max, adv_clip_max]``."""
    kl_coef: float = Field(0.04, ge=0.0)
    """Weight of KL(policy || reference) per step (0: no reference transformer)."""
    std_normalize: bool = True
    """Divide by the group's reward standard deviation."""
    unbiased_std: bool = False
    """Standard deviation with ``n - 1``; Flow-GRPO divides by ``n``."""
    eps: float = Field(1e-4, ge=0.0)
    """Added to the standard deviation."""


class FlowGRPO(DiffusionAlgorithm[FlowGRPOSettings]):
    """Flow-GRPO: group-normalised, clipped advantages; clipped per-step ratio; exact Gaussian KL."""

    name = "flow_grpo"

    @property
    def needs(self) -> AlgorithmNeeds:
        # the reference enters through DiffusionLossInputs.kl (the trainer computes it), not as logprobs
        return AlgorithmNeeds(rollout=True, old_logprobs=True, ref_logprobs=False)

    @property
    def aggregation(self) -> Aggregation:
        return "token_mean"

    @property
    def kl_coef(self) -> float:
        return self.settings.kl_coef

    def compute_advantages(self, inputs: AdvantageInputs) -> Advantages:
        s = self.settings
        out = []
        for group in inputs.groups:
            scalars = over_scored(
                group.rewards,
                group.scored,
                lambda r: group_normalized(r, std_normalize=s.std_normalize, unbiased_std=s.unbiased_std, eps=s.eps),
            )
            clipped = [max(-s.adv_clip_max, min(s.adv_clip_max, a)) for a in scalars]
            out.append(
                [broadcast_to_tokens(a, sample.loss_mask) for a, sample in zip(clipped, group.samples, strict=True)]
            )
        return Advantages(out)

    def loss(self, inputs: LossInputs) -> LossOutput:
        from miles.algorithms.losses import ppo_clip

        s = self.settings
        if inputs.advantages is None:
            raise ValueError("algorithm 'flow_grpo': LossInputs.advantages is required")
        old = inputs.old_logprobs if inputs.old_logprobs is not None else inputs.logprobs.detach()
        pg, metrics = ppo_clip(inputs.logprobs - old, inputs.advantages, clip_low=s.clip_eps, clip_high=s.clip_eps)
        metrics["pg_loss"] = pg.detach()
        total = pg
        kl = inputs.kl if isinstance(inputs, DiffusionLossInputs) else None
        if s.kl_coef > 0.0:
            if kl is None:
                raise ValueError(
                    f"algorithm 'flow_grpo': kl_coef = {s.kl_coef} needs DiffusionLossInputs.kl (train.backend = \"diffusion\")"
                )
            total = total + s.kl_coef * kl
        if kl is not None:
            metrics["kl"] = kl.detach()
        return LossOutput(per_token_loss=total, metrics=metrics)
