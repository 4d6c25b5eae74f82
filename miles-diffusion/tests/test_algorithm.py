from __future__ import annotations

import pytest
import torch

from miles.algorithms.base import AdvantageInputs, LossInputs
from miles.types import Sample, SampleGroup
from miles_diffusion.algorithm import DiffusionLossInputs, FlowGRPO, FlowGRPOSettings


def _group(rewards: list[float], steps: int = 3) -> SampleGroup:
    return SampleGroup(0, [Sample([1], list(range(steps)), [0.0] * steps, [1] * steps, reward=r) for r in rewards])


def test_advantages_are_group_normalised_clipped_and_spread_over_steps() -> None:
    algo = FlowGRPO(FlowGRPOSettings(adv_clip_max=1.5))
    out = algo.compute_advantages(AdvantageInputs([_group([1.0, 0.0, 0.0, 0.0])]))
    # mean 0.25, population std 0.433: (1 - 0.25) / 0.433 = 1.73 -> clipped to 1.5; the others -0.577
    assert out.advantages[0][0].tolist() == pytest.approx([1.5] * 3)
    assert out.advantages[0][1].tolist() == pytest.approx([-0.25 / (0.4330127 + 1e-4)] * 3, rel=1e-5)
    flat = algo.compute_advantages(AdvantageInputs([_group([0.3, 0.3])]))
    assert all(float(a.abs().sum()) == 0.0 for a in flat.advantages[0])


def test_loss_is_the_clipped_ratio_plus_the_exact_kl() -> None:
    algo = FlowGRPO(FlowGRPOSettings(clip_eps=0.1, kl_coef=0.5))
    logprobs = torch.tensor([0.0, 0.5, -0.5], requires_grad=True)
    inputs = DiffusionLossInputs(
        logprobs=logprobs,
        loss_mask=torch.ones(3),
        response_lengths=[3],
        advantages=torch.tensor([1.0, 1.0, -1.0]),
        old_logprobs=torch.zeros(3),
        kl=torch.tensor([0.2, 0.0, 0.4]),
    )
    out = algo.loss(inputs)
    ratio = torch.exp(torch.tensor([0.0, 0.5, -0.5]))
    pg = torch.maximum(-torch.tensor([1.0, 1.0, -1.0]) * ratio, -torch.tensor([1.0, 1.0, -1.0]) * ratio.clamp(0.9, 1.1))
    assert out.per_token_loss.tolist() == pytest.approx((pg + 0.5 * torch.tensor([0.2, 0.0, 0.4])).tolist(), rel=1e-6)
    assert out.metrics["kl"].tolist() == pytest.approx([0.2, 0.0, 0.4])
    assert algo.needs.ref_logprobs is False and algo.aggregation == "token_mean" and algo.kl_coef == 0.5
    with pytest.raises(ValueError, match="kl_coef = 0.5 needs DiffusionLossInputs.kl"):
        algo.loss(
            LossInputs(logprobs=logprobs, loss_mask=torch.ones(3), response_lengths=[3], advantages=torch.ones(3))
        )
