"""The registered algorithms end to end: loss composition, aggregation, PPO's critic, distillation, SFT,
DAPO's tricks, settings errors and conformance."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from miles.algorithms.aggregation import StepDenominators, aggregate_loss
from miles.algorithms.base import AdvantageInputs, LossInputs
from miles.algorithms.builtin import DAPO, GRPO, GSPO, PPO, RLOO, SFT, Distill, DrGRPO, ReinforcePP, ReinforcePPBaseline
from miles.algorithms.losses import kl_estimate, ppo_clip
from miles.algorithms.settings import (
    DAPOSettings,
    DistillSettings,
    DrGRPOSettings,
    GRPOSettings,
    GSPOSettings,
    PPOSettings,
    ReinforcePPSettings,
    RLOOSettings,
    SFTSettings,
)
from miles.testing import check_algorithm
from miles.types import Sample, SampleGroup

ALL = (GRPO, DrGRPO, DAPO, GSPO, RLOO, ReinforcePP, ReinforcePPBaseline, PPO, SFT, Distill)


def composed_inputs() -> LossInputs:
    return LossInputs(
        logprobs=torch.tensor([-1.0, -2.0, -0.5], requires_grad=True),
        loss_mask=torch.tensor([1, 1, 1]),
        response_lengths=[2, 1],
        advantages=torch.tensor([1.0, 1.0, -1.0]),
        old_logprobs=torch.tensor([-1.1, -1.8, -0.5]),
        rollout_logprobs=torch.tensor([-1.5, -1.8, -0.2]),
        ref_logprobs=torch.tensor([-1.2, -2.0, -1.0]),
        entropy=torch.tensor([1.0, 2.0, 0.5]),
    )


def test_ppo_clip_plus_k3_kl_plus_tis_plus_entropy_is_the_sum_of_the_parts() -> None:
    algo = GRPO(
        GRPOSettings(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, mismatch_correction="tis", tis_clip=1.2)
    )
    assert algo.needs.ref_logprobs and algo.needs.entropy and not algo.needs.values
    inputs = composed_inputs()
    out = algo.loss(inputs)
    # log(pi / pi_old) = 0.1, -0.2, 0 -> ratios 1.105171, 0.818731, 1 (all inside [0.8, 1.2]: no clip)
    # pg = -A r = -1.105171, -0.818731, +1.0
    # TIS: log(pi_old / pi_rollout) = 0.4, 0, -0.3 -> 1.491825 (cut to 1.2), 1, 0.740818
    # k3 with log(pi / ref) = 0.2, 0, 0.5: exp(-0.2) - 0.8 = 0.018731, 0, exp(-0.5) - 0.5 = 0.106531
    # entropy bonus: -0.01 * (1, 2, 0.5)
    pg = [-1.105171, -0.818731, 1.0]
    w = [1.2, 1.0, 0.740818]
    k3 = [0.018731, 0.0, 0.106531]
    ent = [1.0, 2.0, 0.5]
    expected = [w[i] * pg[i] + 0.1 * k3[i] - 0.01 * ent[i] for i in range(3)]
    assert expected == pytest.approx([-1.334332, -0.838731, 0.746471], abs=1e-6)
    assert out.per_token_loss.tolist() == pytest.approx(expected, abs=1e-5)
    assert out.metrics["tis_clipfrac"].tolist() == [1.0, 0.0, 0.0]
    assert out.metrics["kl"].tolist() == pytest.approx(k3, abs=1e-6)
    assert out.metrics["clipfrac"].tolist() == [0.0, 0.0, 0.0]
    out.per_token_loss.sum().backward()
    # d/dlogp: w * (-A r) + 0.1 * (1 - exp(-lr_ref)); entropy is an input here (no gradient to logp)
    grad = [1.2 * -1.105171 + 0.1 * 0.181269, -0.818731, 0.740818 + 0.1 * 0.393469]
    assert inputs.logprobs.grad.tolist() == pytest.approx(grad, abs=1e-5)

    # the same parts computed one by one with the building blocks
    parts = composed_inputs()
    pg_t, _ = ppo_clip(parts.logprobs - parts.old_logprobs, parts.advantages, clip_low=0.2, clip_high=0.2)
    tis = torch.exp(parts.old_logprobs - parts.rollout_logprobs).clamp(max=1.2)
    kl_t = kl_estimate(parts.logprobs, parts.ref_logprobs, "k3")
    total = tis * pg_t + 0.1 * kl_t - 0.01 * parts.entropy
    assert torch.allclose(out.per_token_loss.detach(), total.detach(), atol=1e-6)
    # and switching a term off removes exactly that term
    no_kl = GRPO(GRPOSettings(entropy_coef=0.01, mismatch_correction="tis", tis_clip=1.2)).loss(composed_inputs())
    assert torch.allclose(out.per_token_loss.detach() - no_kl.per_token_loss.detach(), 0.1 * kl_t.detach(), atol=1e-6)


def test_aggregation_modes_on_the_algorithm_loss() -> None:
    per_token = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.tensor([1, 1, 1, 0])  # the last token (a tool token) does not count
    lengths = [2, 2]
    den = StepDenominators(num_tokens=3, num_sequences=2, seq_len_norm=4.0)
    # token_mean: (1 + 2 + 3) / 3 = 2
    assert aggregate_loss(per_token, mask, lengths, DAPO(DAPOSettings()).aggregation, den).item() == pytest.approx(2.0)
    # seq_mean_token_mean: ((1 + 2) / 2 + 3 / 1) / 2 = 2.25
    assert aggregate_loss(per_token, mask, lengths, GRPO(GRPOSettings()).aggregation, den).item() == pytest.approx(2.25)
    # Dr.GRPO seq_mean_token_sum_norm: ((1 + 2) / 4 + 3 / 4) / 2 = 0.75
    dr = DrGRPO(DrGRPOSettings(max_response_length=4))
    den = StepDenominators(num_tokens=3, num_sequences=2, seq_len_norm=dr.seq_len_norm)
    assert aggregate_loss(per_token, mask, lengths, dr.aggregation, den).item() == pytest.approx(0.75)


def test_gspo_sequence_clip_by_hand() -> None:
    algo = GSPO(GSPOSettings())
    inputs = LossInputs(
        logprobs=torch.tensor([-1.0, -2.0, -0.5, -0.5], requires_grad=True),
        loss_mask=torch.tensor([1, 1, 1, 1]),
        response_lengths=[2, 2],
        advantages=torch.tensor([1.0, 1.0, -1.0, -1.0]),
        old_logprobs=torch.tensor([-1.2, -2.4, -0.5, -1.5]),
    )
    out = algo.loss(inputs)
    # seq 1: mean log ratio 0.3 -> s = 1.349859 > 1.0004: clipped, loss -1.0004 (no gradient)
    # seq 2: mean log ratio 0.5 -> s = 1.648721, A = -1: max(1.648721, 1.0004) = 1.648721
    assert out.per_token_loss.tolist() == pytest.approx([-1.0004, -1.0004, 1.648721, 1.648721], abs=1e-6)
    assert out.metrics["clipfrac"].tolist() == [1.0, 1.0, 0.0, 0.0]
    out.per_token_loss.sum().backward()
    assert inputs.logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 1.648721, 1.648721], abs=1e-6)


def test_ppo_gae_returns_and_value_loss_by_hand() -> None:
    sample = Sample(
        prompt_ids=[1], response_ids=[5, 6, 7], rollout_logprobs=[-1.0] * 3, loss_mask=[1, 1, 1], reward=1.0
    )
    groups = [SampleGroup(0, [sample])]
    values = [[torch.tensor([0.5, 0.6, 0.7])]]
    algo = PPO(PPOSettings(gamma=0.9, lam=0.8, normalize_advantages=False))
    assert algo.needs.values
    # the GAE numbers of test_advantages.test_gae_by_hand
    assert algo.compute_advantages(AdvantageInputs(groups, values)).advantages[0][0].tolist() == pytest.approx(
        [0.21712, 0.246, 0.3], abs=1e-6
    )
    assert algo.compute_advantages(AdvantageInputs(groups, values)).returns[0][0].tolist() == pytest.approx(
        [0.71712, 0.846, 1.0], abs=1e-6
    )
    whitened = (
        PPO(PPOSettings(gamma=0.9, lam=0.8, eps=0.0))
        .compute_advantages(AdvantageInputs(groups, values))
        .advantages[0][0]
    )
    assert whitened.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert whitened.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="values"):
        algo.compute_advantages(AdvantageInputs(groups))

    # loss: ratio 1 -> pg = -A = -1, +2; value: t0 0.5 * max((0.5-1)^2, (0.5-1)^2) = 0.125,
    # t1 0.5 * (1 - 0)^2 = 0.5 (clipped V = 1.0 + 0 = same); times value_coef 0.5 -> 0.0625, 0.25
    values_t = torch.tensor([0.5, 1.0], requires_grad=True)
    out = PPO(PPOSettings(value_coef=0.5, value_clip=0.2)).loss(
        LossInputs(
            logprobs=torch.tensor([-1.0, -1.0], requires_grad=True),
            loss_mask=torch.tensor([1, 1]),
            response_lengths=[2],
            advantages=torch.tensor([1.0, -2.0]),
            old_logprobs=torch.tensor([-1.0, -1.0]),
            values=values_t,
            old_values=torch.tensor([0.4, 1.0]),
            returns=torch.tensor([1.0, 0.0]),
        )
    )
    assert out.per_token_loss.tolist() == pytest.approx([-1.0 + 0.0625, 2.0 + 0.25])
    out.per_token_loss.sum().backward()
    # d/dV 0.5 * 0.5 * (V - R)^2 = 0.5 * (V - R): -0.25, 0.5
    assert values_t.grad.tolist() == pytest.approx([-0.25, 0.5])


def test_distillation_alone_and_added_to_rl() -> None:
    logp = torch.tensor([-1.0, -2.0])
    teacher = torch.tensor([-1.5, -1.0])
    base = dict(loss_mask=torch.tensor([1, 1]), response_lengths=[2], teacher_logprobs=teacher)
    distill = Distill(DistillSettings())
    assert distill.needs.teacher_logprobs and not distill.needs.values and not distill.needs.old_logprobs
    assert Distill(DistillSettings(policy_coef=0.5)).needs.old_logprobs
    out = distill.loss(LossInputs(logprobs=logp.clone().requires_grad_(True), **base))
    assert out.per_token_loss.tolist() == pytest.approx([0.5, -1.0])  # log pi - log teacher
    # added to GRPO: pg (ratio 1: -A) + 0.5 * (log pi - log teacher)
    grpo = GRPO(GRPOSettings(distill_coef=0.5))
    assert grpo.needs.teacher_logprobs
    out = grpo.loss(
        LossInputs(logprobs=logp.clone().requires_grad_(True), advantages=torch.tensor([1.0, -1.0]), **base)
    )
    assert out.per_token_loss.tolist() == pytest.approx([-1.0 + 0.25, 1.0 - 0.5])
    with pytest.raises(ValueError, match="teacher_logprobs"):
        grpo.loss(
            LossInputs(logprobs=logp, loss_mask=torch.tensor([1, 1]), response_lengths=[2], advantages=torch.zeros(2))
        )


def test_topk_distillation_alone_masked_and_added_to_rl() -> None:
    from miles.algorithms.losses import distill_topk_reverse_kl

    distill = Distill(DistillSettings(distill_mode="topk", distill_topk=2))
    needs = distill.needs
    assert needs.teacher_topk == 2 and not needs.teacher_logprobs and not needs.old_logprobs
    assert Distill(DistillSettings()).needs.teacher_topk == 0
    # two positions, the second not trained (loss_mask 0): only the first one's KL reaches the loss
    student = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.1]])).requires_grad_(True)
    teacher = torch.log(torch.tensor([[0.25, 0.25], [0.7, 0.2]]))
    logp = torch.tensor([-0.7, -2.3], requires_grad=True)
    base = dict(
        loss_mask=torch.tensor([1, 0]),
        response_lengths=[2],
        teacher_topk_logprobs=teacher,
        student_topk_logprobs=student,
    )
    out = distill.loss(LossInputs(logprobs=logp, **base))
    expected = 2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(2 / 3)
    assert out.per_token_loss[0].item() == pytest.approx(expected, abs=1e-6)
    assert "distill_topk_reverse_kl" in out.metrics
    loss = aggregate_loss(out.per_token_loss, base["loss_mask"], [2], distill.aggregation, StepDenominators(1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert student.grad is not None and student.grad[1].abs().max().item() == 0.0
    assert student.grad[0].abs().max().item() > 0.0
    # unnormalised setting
    plain = Distill(DistillSettings(distill_mode="topk", distill_topk=2, distill_topk_renormalize=False))
    out = plain.loss(LossInputs(logprobs=logp, **base))
    assert out.per_token_loss[0].item() == pytest.approx(0.5 * math.log(2) - 0.25, abs=1e-6)
    # added to GRPO: pg (ratio 1: -A) + 0.5 * D
    grpo = GRPO(GRPOSettings(distill_coef=0.5, distill_mode="topk", distill_topk=2))
    assert grpo.needs.teacher_topk == 2 and not grpo.needs.teacher_logprobs
    out = grpo.loss(LossInputs(logprobs=logp.detach().clone().requires_grad_(True), advantages=torch.ones(2), **base))
    d = distill_topk_reverse_kl(student.detach(), teacher)
    assert out.per_token_loss.tolist() == pytest.approx((-1.0 + 0.5 * d).tolist(), abs=1e-6)
    missing = dict(logprobs=logp, loss_mask=torch.ones(2), response_lengths=[2], advantages=torch.ones(2))
    with pytest.raises(ValueError, match="LossInputs.student_topk_logprobs is required"):
        grpo.loss(LossInputs(**missing, teacher_topk_logprobs=teacher))
    with pytest.raises(ValueError, match=r"must both be \[T, k\]"):
        grpo.loss(LossInputs(**missing, teacher_topk_logprobs=teacher, student_topk_logprobs=student[:, :1]))


def test_sft_alone_and_added_to_rl() -> None:
    sft = SFT(SFTSettings())
    assert not sft.needs.rollout and not sft.needs.old_logprobs
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    out = sft.loss(LossInputs(logprobs=logp, loss_mask=torch.tensor([1, 0]), response_lengths=[2]))
    assert out.per_token_loss.tolist() == [1.0, 2.0]
    assert (
        aggregate_loss(out.per_token_loss, torch.tensor([1, 0]), [2], sft.aggregation, StepDenominators(1, 1)).item()
        == 1.0
    )
    grpo = GRPO(GRPOSettings(sft_coef=0.1))
    out = grpo.loss(
        LossInputs(
            logprobs=logp, loss_mask=torch.tensor([1, 1]), response_lengths=[2], advantages=torch.tensor([1.0, 1.0])
        )
    )
    assert out.per_token_loss.tolist() == pytest.approx([-1.0 + 0.1, -1.0 + 0.2])
    with pytest.raises(ValidationError, match="max_response_length"):
        SFTSettings(loss_aggregation="seq_mean_token_sum_norm")


def test_dapo_dynamic_sampling_and_overlong_shaping() -> None:
    def group(gid: int, rewards: list[float], lengths: list[int]) -> SampleGroup:
        return SampleGroup(
            gid,
            [
                Sample(
                    prompt_ids=[1],
                    response_ids=[3] * n,
                    rollout_logprobs=[-1.0] * n,
                    loss_mask=[1] * n,
                    reward=r,
                    group_id=gid,
                    index=i,
                )
                for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))
            ],
        )

    groups = [
        group(0, [1.0, 0.0], [2, 2]),
        group(1, [1.0, 1.0], [2, 2]),
        group(2, [0.5], [1]),
        group(3, [0.0, 0.0, 1.0], [1, 1, 1]),
    ]
    dapo = DAPO(DAPOSettings())
    assert dapo.keep_groups(groups) == [True, False, False, True]
    assert GRPO(GRPOSettings()).keep_groups(groups) == [True] * 4
    assert dapo.s.clip_eps_high == 0.28 and dapo.aggregation == "token_mean"
    # overlong: max 10, buffer 4 -> lengths 6 and 8 cost 0 and 0.5; rewards 1, 1 -> 1, 0.5
    # GRPO on (1, 0.5): mean 0.75, deviations +-0.25, unbiased std 0.353553 -> +-0.707107
    shaped = DAPO(DAPOSettings(max_response_length=10, overlong_buffer_length=4, eps=0.0))
    adv = shaped.compute_advantages(AdvantageInputs([group(0, [1.0, 1.0], [6, 8])])).advantages
    assert adv[0][0][0].item() == pytest.approx(0.707107, abs=1e-6)
    assert adv[0][1][0].item() == pytest.approx(-0.707107, abs=1e-6)


def test_a_failed_sample_counts_in_no_group_statistic() -> None:
    """A sample whose generation or reward failed has no reward (``None``) and trains on nothing. Counted as 0 in
    its group's statistics, it moved the other samples' advantages (three equal rewards and a failure gave the
    three a positive advantage each), kept a group of otherwise equal rewards under DAPO's dynamic sampling, and
    moved REINFORCE++-baseline's group mean; now the group's scored samples alone make those statistics."""
    from miles.types import SampleStatus

    def group(rewards: list[float | None]) -> SampleGroup:
        samples = [
            Sample(
                prompt_ids=[1],
                response_ids=[3, 4],
                rollout_logprobs=[-1.0, -1.0],
                loss_mask=[1, 1] if r is not None else [0, 0],
                reward=r,
                group_id=0,
                index=i,
                status=SampleStatus.COMPLETED if r is not None else SampleStatus.FAILED,
            )
            for i, r in enumerate(rewards)
        ]
        return SampleGroup(0, samples)

    def scalars(algo: object, g: SampleGroup) -> list[float]:
        out = algo.compute_advantages(AdvantageInputs([g])).advantages[0]  # type: ignore[attr-defined]
        return [float(t[0]) for t in out]

    equal_and_failed = group([1.0, 1.0, 1.0, None])
    for cls, settings in ((GRPO, GRPOSettings()), (RLOO, RLOOSettings()), (DrGRPO, DrGRPOSettings())):
        assert scalars(cls(settings), equal_and_failed) == [0.0] * 4, cls.__name__
    # the scored ones as if alone: GRPO on (1, 0) -> +-0.707107 (unbiased std, eps 0); the failed one 0
    assert scalars(GRPO(GRPOSettings(eps=0.0)), group([1.0, None, 0.0])) == pytest.approx([0.707107, 0.0, -0.707107])
    assert DAPO(DAPOSettings()).keep_groups([equal_and_failed, group([1.0, None, 0.0])]) == [False, True]
    # REINFORCE++-baseline: the group mean over the scored samples (1.0) leaves nothing to whiten
    baseline = ReinforcePPBaseline(ReinforcePPSettings())
    assert all(
        a.abs().max().item() == 0.0
        for a in baseline.compute_advantages(AdvantageInputs([equal_and_failed])).advantages[0]
    )


def test_settings_errors_name_the_field() -> None:
    with pytest.raises(ValidationError, match="max_response_length"):
        DrGRPOSettings(max_response_length=0)
    with pytest.raises(ValidationError, match="max_response_length"):
        GRPOSettings(loss_aggregation="seq_mean_token_sum_norm")
    with pytest.raises(ValidationError, match="icepop_low"):
        GRPOSettings(icepop_low=2.0, icepop_high=1.5)
    with pytest.raises(ValidationError, match="clip_eps_hgh"):
        GRPOSettings(clip_eps_hgh=0.3)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="LossInputs.ref_logprobs"):
        GRPO(GRPOSettings(kl_coef=0.1)).loss(
            LossInputs(
                logprobs=torch.zeros(1), loss_mask=torch.ones(1), response_lengths=[1], advantages=torch.zeros(1)
            )
        )
    with pytest.raises(ValueError, match="LossInputs.rollout_logprobs"):
        GRPO(GRPOSettings(mismatch_correction="icepop")).loss(
            LossInputs(
                logprobs=torch.zeros(1), loss_mask=torch.ones(1), response_lengths=[1], advantages=torch.zeros(1)
            )
        )


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.name)
def test_conformance(cls: type) -> None:
    check_algorithm(cls)


def test_conformance_with_every_term_on() -> None:
    check_algorithm(
        GRPO,
        settings=dict(
            kl_coef=0.1, entropy_coef=0.01, mismatch_correction="tis", dual_clip=3.0, sft_coef=0.1, distill_coef=0.1
        ),
    )
    check_algorithm(GSPO, settings=dict(mismatch_correction="icepop", mismatch_level="sequence"))
    check_algorithm(Distill, settings=dict(distill_mode="topk", distill_topk=3))
    check_algorithm(GRPO, settings=dict(distill_coef=0.2, distill_mode="topk", distill_topk=4))
    check_algorithm(PPO, settings=dict(kl_coef=0.05, mismatch_correction="tis", mismatch_level="geometric"))


def test_zero_length_and_fully_masked_batches_are_finite() -> None:
    algo = GRPO(GRPOSettings(kl_coef=0.1, mismatch_correction="tis", mismatch_level="sequence"))
    empty = torch.zeros(0, requires_grad=True)
    out = algo.loss(
        LossInputs(
            logprobs=empty,
            loss_mask=torch.zeros(0),
            response_lengths=[0, 0],
            advantages=torch.zeros(0),
            rollout_logprobs=torch.zeros(0),
            ref_logprobs=torch.zeros(0),
        )
    )
    assert out.per_token_loss.shape == (0,)
    agg = aggregate_loss(out.per_token_loss, torch.zeros(0), [0, 0], algo.aggregation, StepDenominators(0, 2))
    assert agg.item() == 0.0 and not math.isnan(agg.item())
