"""Advantage estimators against hand-worked numbers (written out in each test)."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algorithms.advantages import (
    broadcast_to_tokens,
    gae,
    global_token_normalize,
    group_normalized,
    kl_penalized_returns,
    overlong_penalty,
    rloo,
)
from miles.algorithms.base import AdvantageInputs, LossInputs
from miles.algorithms.builtin import GRPO, RLOO, DrGRPO, ReinforcePP, ReinforcePPBaseline
from miles.algorithms.settings import DrGRPOSettings, GRPOSettings, ReinforcePPSettings, RLOOSettings
from miles.types import Sample, SampleGroup


def make_group(gid: int, rewards: list[float], masks: list[list[int]]) -> SampleGroup:
    samples = [
        Sample(
            prompt_ids=[1, 2],
            response_ids=[7] * len(m),
            rollout_logprobs=[-1.0] * len(m),
            loss_mask=m,
            reward=r,
            group_id=gid,
            index=i,
        )
        for i, (r, m) in enumerate(zip(rewards, masks, strict=True))
    ]
    return SampleGroup(gid, samples)


def test_grpo_group_normalisation_by_hand() -> None:
    # rewards 2, 0, 1, 1: mean 1, deviations 1, -1, 0, 0
    # unbiased var = (1 + 1) / 3 = 2/3 -> std 0.8165 -> 1 / 0.8165 = sqrt(1.5) = 1.224745
    assert group_normalized([2, 0, 1, 1], eps=0.0) == pytest.approx([1.224745, -1.224745, 0.0, 0.0], abs=1e-6)
    # population var = 2 / 4 = 0.5 -> std 0.7071 -> 1.414214
    assert group_normalized([2, 0, 1, 1], unbiased_std=False, eps=0.0) == pytest.approx(
        [1.414214, -1.414214, 0, 0], abs=1e-6
    )
    # Dr.GRPO: r - mean only
    assert group_normalized([2, 0, 1, 1], std_normalize=False) == [1.0, -1.0, 0.0, 0.0]
    # a group of one, all-equal rewards, an empty group
    assert group_normalized([0.7]) == [0.0]
    assert group_normalized([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]
    assert group_normalized([]) == []


def test_rloo_by_hand() -> None:
    # r_i - mean of the others: 2 - (0+1+1)/3 = 4/3; 0 - 4/3; 1 - 3/3 = 0; 0
    assert rloo([2, 0, 1, 1]) == pytest.approx([4 / 3, -4 / 3, 0.0, 0.0])
    assert rloo([5.0]) == [0.0]
    assert rloo([1.0, 1.0]) == [0.0, 0.0]


def test_grpo_algorithm_broadcasts_over_trained_tokens() -> None:
    # masks: a tool span in sample 0, a zero-length response in sample 3
    groups = [make_group(0, [2, 0, 1, 1], [[1, 0, 1], [1, 1], [1], []]), make_group(1, [0.3], [[1, 1]])]
    algo = GRPO(GRPOSettings(eps=0.0))
    adv = algo.compute_advantages(AdvantageInputs(groups)).advantages
    a = 1.224745
    assert adv[0][0].tolist() == pytest.approx([a, 0.0, a], abs=1e-6)
    assert adv[0][1].tolist() == pytest.approx([-a, -a], abs=1e-6)
    assert adv[0][2].tolist() == [0.0]
    assert adv[0][3].shape == (0,)
    assert adv[1][0].tolist() == [0.0, 0.0]  # group of one


def test_dr_grpo_and_rloo_algorithms() -> None:
    groups = [make_group(0, [2, 0, 1, 1], [[1, 1], [1], [1], [1, 0]])]
    dr = DrGRPO(DrGRPOSettings(max_response_length=8))
    assert [t.tolist() for t in dr.compute_advantages(AdvantageInputs(groups)).advantages[0]] == [
        [1.0, 1.0],
        [-1.0],
        [0.0],
        [0.0, 0.0],
    ]
    assert dr.aggregation == "seq_mean_token_sum_norm" and dr.seq_len_norm == 8.0
    r = RLOO(RLOOSettings())
    got = [t.tolist() for t in r.compute_advantages(AdvantageInputs(groups)).advantages[0]]
    assert got[0] == pytest.approx([4 / 3, 4 / 3]) and got[1] == pytest.approx([-4 / 3])


def test_global_token_normalize_by_hand() -> None:
    # trained tokens 1, 1, -1 (the 0 at a masked position is ignored)
    # mean 1/3; var = ((2/3)^2 * 2 + (4/3)^2) / 3 = 8/9; std = 0.942809
    # (1 - 1/3) / 0.942809 = 0.707107; (-1 - 1/3) / 0.942809 = -1.414214
    advs = [torch.tensor([1.0, 1.0]), torch.tensor([-1.0, 5.0])]
    masks = [torch.tensor([1, 1]), torch.tensor([1, 0])]
    out = global_token_normalize(advs, masks, eps=0.0)
    assert out[0].tolist() == pytest.approx([0.707107, 0.707107], abs=1e-6)
    assert out[1].tolist() == pytest.approx([-1.414214, 0.0], abs=1e-6)
    # nothing trained at all
    assert global_token_normalize([torch.zeros(2)], [torch.zeros(2)])[0].tolist() == [0.0, 0.0]


def test_reinforce_pp_by_hand() -> None:
    # group 0: rewards 1 (2 tokens), 0 (1 token); group 1: reward 1 with an empty response
    # tokens 1, 1, 0: mean 2/3, var = ((1/3)^2 * 2 + (2/3)^2) / 3 = 2/9, std 0.471405
    # (1/3) / 0.471405 = 0.707107; (-2/3) / 0.471405 = -1.414214
    groups = [make_group(0, [1, 0], [[1, 1], [1]]), make_group(1, [1], [[]])]
    adv = ReinforcePP(ReinforcePPSettings(eps=0.0)).compute_advantages(AdvantageInputs(groups)).advantages
    assert adv[0][0].tolist() == pytest.approx([0.707107, 0.707107], abs=1e-6)
    assert adv[0][1].tolist() == pytest.approx([-1.414214], abs=1e-6)
    assert adv[1][0].shape == (0,)


def test_reinforce_pp_baseline_by_hand() -> None:
    # group 0: rewards 3, 1 -> minus mean 2 -> 1, -1 ; group 1: one sample -> 0 (2 tokens)
    # tokens 1, 1, -1, 0, 0: mean 0.2, var = (0.64*2 + 1.44 + 0.04*2) / 5 = 0.56, std 0.748331
    # (1 - 0.2) / 0.748331 = 1.069045; (-1.2) / 0.748331 = -1.603567; (-0.2) / 0.748331 = -0.267261
    groups = [make_group(0, [3, 1], [[1, 1], [1]]), make_group(1, [9], [[1, 1]])]
    adv = ReinforcePPBaseline(ReinforcePPSettings(eps=0.0)).compute_advantages(AdvantageInputs(groups)).advantages
    assert adv[0][0].tolist() == pytest.approx([1.069045, 1.069045], abs=1e-6)
    assert adv[0][1].tolist() == pytest.approx([-1.603567], abs=1e-6)
    assert adv[1][0].tolist() == pytest.approx([-0.267261, -0.267261], abs=1e-6)


def test_kl_penalized_returns_by_hand() -> None:
    # token rewards: -0.5 * kl = -0.05, -0.1, -0.15 (+1 on the last) -> returns (gamma 1): 0.7, 0.75, 0.85
    out = kl_penalized_returns(1.0, torch.tensor([0.1, 0.2, 0.3]), torch.tensor([1, 1, 1]), kl_coef=0.5)
    assert out.tolist() == pytest.approx([0.7, 0.75, 0.85], abs=1e-6)
    # a masked middle token gets 0 and does not contribute its KL
    out = kl_penalized_returns(1.0, torch.tensor([0.1, 9.0, 0.3]), torch.tensor([1, 0, 1]), kl_coef=0.5)
    assert out.tolist() == pytest.approx([0.8, 0.0, 0.85], abs=1e-6)
    assert kl_penalized_returns(1.0, torch.zeros(0), torch.zeros(0), kl_coef=0.5).shape == (0,)


def test_reinforce_pp_with_kl_in_reward() -> None:
    # one group of two one-token samples; rollout logprob -1, ref -1.5 -> k1 = 0.5; coef 0.2 -> -0.1 per token
    # returns: 1 - 0.1 = 0.9 and 0 - 0.1 = -0.1 -> whitened: +1, -1
    groups = [make_group(0, [1.0, 0.0], [[1], [1]])]
    algo = ReinforcePP(ReinforcePPSettings(kl_coef=0.2, kl_in_reward=True, kl_estimator="k1", eps=0.0))
    assert algo.needs.ref_logprobs_for_advantages
    ref = [[torch.tensor([-1.5]), torch.tensor([-1.5])]]
    adv = algo.compute_advantages(AdvantageInputs(groups, ref_logprobs=ref)).advantages
    assert [a.item() for a in adv[0]] == pytest.approx([1.0, -1.0])
    with pytest.raises(ValueError, match="ref_logprobs"):
        algo.compute_advantages(AdvantageInputs(groups))


def test_gae_by_hand() -> None:
    # rewards 0, 0, 1; values 0.5, 0.6, 0.7; gamma 0.9, lambda 0.8 (gamma * lambda = 0.72)
    # t=2: delta = 1 - 0.7 = 0.3                     A = 0.3
    # t=1: delta = 0.9 * 0.7 - 0.6 = 0.03            A = 0.03 + 0.72 * 0.3 = 0.246
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04            A = 0.04 + 0.72 * 0.246 = 0.21712
    adv, ret = gae(
        torch.tensor([0.0, 0, 1]), torch.tensor([0.5, 0.6, 0.7]), torch.tensor([1, 1, 1]), gamma=0.9, lam=0.8
    )
    assert adv.tolist() == pytest.approx([0.21712, 0.246, 0.3], abs=1e-6)
    assert ret.tolist() == pytest.approx([0.71712, 0.846, 1.0], abs=1e-6)
    # a tool token in the middle is skipped: t=0 bootstraps from t=2's value
    # t=2: A = 0.3; t=0: delta = 0.9 * 0.7 - 0.5 = 0.13, A = 0.13 + 0.72 * 0.3 = 0.346
    adv, ret = gae(
        torch.tensor([0.0, 0, 1]), torch.tensor([0.5, 9.9, 0.7]), torch.tensor([1, 0, 1]), gamma=0.9, lam=0.8
    )
    assert adv.tolist() == pytest.approx([0.346, 0.0, 0.3], abs=1e-6)
    assert ret.tolist() == pytest.approx([0.846, 0.0, 1.0], abs=1e-6)
    # lambda = 1, gamma = 1: Monte-Carlo return minus value
    adv, _ = gae(torch.tensor([0.0, 2.0]), torch.tensor([0.5, 1.5]), torch.tensor([1, 1]), gamma=1.0, lam=1.0)
    assert adv.tolist() == pytest.approx([1.5, 0.5])
    empty, _ = gae(torch.zeros(0), torch.zeros(0), torch.zeros(0), gamma=1.0, lam=1.0)
    assert empty.shape == (0,)


def test_overlong_penalty_by_hand() -> None:
    # max 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 from 10 on
    got = [overlong_penalty(n, max_length=10, buffer_length=4) for n in (0, 6, 7, 8, 10, 12)]
    assert got == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(99, max_length=10, buffer_length=0) == 0.0
    assert overlong_penalty(8, max_length=10, buffer_length=4, factor=2.0) == -1.0


def test_broadcast_to_tokens() -> None:
    assert broadcast_to_tokens(2.5, [1, 0, 1]).tolist() == [2.5, 0.0, 2.5]
    assert broadcast_to_tokens(2.5, []).shape == (0,)
    assert not math.isnan(broadcast_to_tokens(0.0, [1]).item())


def test_group_algorithms_with_kl_in_reward() -> None:
    # rollout logprob -1 on every token, ref -1.5 -> k1 = 0.5 per token; kl_coef 0.2
    # sample 0: 2 trained tokens (a third is a tool token) -> 1 - 0.2 * 1.0 = 0.8; sample 1: 1 token -> 0 - 0.1
    # Dr.GRPO: mean 0.35 -> 0.45, -0.45
    groups = [make_group(0, [1.0, 0.0], [[1, 0, 1], [1]])]
    algo = DrGRPO(DrGRPOSettings(kl_coef=0.2, kl_in_reward=True, kl_estimator="k1", max_response_length=4))
    assert algo.needs.ref_logprobs_for_advantages
    ref = [[torch.tensor([-1.5, -9.0, -1.5]), torch.tensor([-1.5])]]
    adv = algo.compute_advantages(AdvantageInputs(groups, ref_logprobs=ref)).advantages
    assert adv[0][0].tolist() == pytest.approx([0.45, 0.0, 0.45])
    assert adv[0][1].tolist() == pytest.approx([-0.45])
    with pytest.raises(ValueError, match="ref_logprobs"):
        algo.compute_advantages(AdvantageInputs(groups))
    # in the reward, the KL is not also added to the loss
    out = algo.loss(
        LossInputs(
            logprobs=torch.tensor([-1.0]),
            loss_mask=torch.ones(1),
            response_lengths=[1],
            advantages=torch.tensor([1.0]),
            old_logprobs=torch.tensor([-1.0]),
            ref_logprobs=torch.tensor([-1.5]),
        )
    )
    assert out.per_token_loss.tolist() == [-1.0]
    assert out.metrics["kl"].tolist() == [0.5]
