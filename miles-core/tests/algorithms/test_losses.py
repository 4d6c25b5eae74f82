"""Per-token loss terms and mismatch corrections against hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algorithms.correction import icepop_weights, mismatch_log_ratio, tis_weights
from miles.algorithms.losses import (
    distill_reverse_kl,
    distill_topk_reverse_kl,
    kl_estimate,
    nll,
    ppo_clip,
    sequence_log_ratio,
    value_loss,
)


def test_kl_estimators_by_hand() -> None:
    # log pi = -1, -2; log ref = -1.5, -1 -> log ratio 0.5, -1
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    # k3 = exp(-lr) - 1 + lr: exp(-0.5) - 0.5 = 0.106531; e - 2 = 0.718282
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([0.106531, 0.718282], abs=1e-6)
    assert kl_estimate(ref, ref, "k3").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_ppo_clip_higher_by_hand() -> None:
    # ratios 1.5, 0.5, 1.1, 0.7; advantages 1, 1, -1, -1; clip range [0.8, 1.28]
    # t0: max(-1.5, -1.28) = -1.28 (clipped)   t1: max(-0.5, -0.8) = -0.5
    # t2: max(1.1, 1.1) = 1.1                   t3: max(0.7, 0.8) = 0.8 (clipped)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, m = ppo_clip(logp, adv, clip_low=0.2, clip_high=0.28)
    assert loss.tolist() == pytest.approx([-1.28, -0.5, 1.1, 0.8], abs=1e-6)
    assert m["clipfrac"].tolist() == [1.0, 0.0, 0.0, 1.0]
    loss.sum().backward()
    # d(-A r)/d log r = -A r on unclipped tokens, 0 on clipped ones
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5, 1.1, 0.0], abs=1e-6)


def test_dual_clip_by_hand() -> None:
    # ratio 5, A = -1: PPO loss max(5, 1.28) = 5 -> dual clip bounds it at -A * 3 = 3
    # ratio 5, A = +1: dual clip does not apply to positive advantages: max(-5, -1.28) = -1.28
    logp = torch.log(torch.tensor([5.0, 5.0]))
    loss, m = ppo_clip(logp, torch.tensor([-1.0, 1.0]), clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert loss.tolist() == pytest.approx([3.0, -1.28])
    assert m["dual_clipfrac"].tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip(logp, torch.tensor([1.0, 1.0]), clip_low=0.2, clip_high=0.2, dual_clip=1.0)


def test_sequence_log_ratio_by_hand() -> None:
    # seq 1: (log pi - log old) = 0.2, 0.4 -> mean 0.3
    # seq 2: 0, 1.0 and a masked token (ignored) -> mean 0.5; seq 3: empty
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.5, -3.0], requires_grad=True)
    old = torch.tensor([-1.2, -2.4, -0.5, -1.5, 0.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    out = sequence_log_ratio(logp, old, mask, [2, 3, 0])
    assert out.tolist() == pytest.approx([0.3, 0.3, 0.5, 0.5, 0.5], abs=1e-6)
    out.sum().backward()
    assert logp.grad.tolist() == [1.0] * 5  # each token's own logprob carries the gradient


def test_value_loss_by_hand() -> None:
    # t0: V 1.0, V_old 0.5, R 2: unclipped (1-2)^2 = 1; clipped V = 0.5 + 0.2 = 0.7 -> 1.69 -> 0.5 * 1.69
    # t1: V 0.0, V_old 0.1, R 0: unclipped 0; clipped 0.1 - 0.1 = 0.0 -> 0
    loss, m = value_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.1]), torch.tensor([2.0, 0.0]), clip=0.2)
    assert loss.tolist() == pytest.approx([0.845, 0.0])
    assert m["value_clipfrac"].tolist() == [1.0, 0.0]
    loss, _ = value_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.1]), torch.tensor([2.0, 0.0]), clip=None)
    assert loss.tolist() == pytest.approx([0.5, 0.0])


def test_nll_and_distillation_by_hand() -> None:
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    assert nll(logp).tolist() == [1.0, 2.0]
    teacher = torch.tensor([-1.5, -1.0])
    term = distill_reverse_kl(logp, teacher)
    # value: log pi - log teacher = 0.5, -1; gradient: the same numbers (score-function gradient)
    assert term.tolist() == pytest.approx([0.5, -1.0])
    term.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.5, -1.0])


def test_tis_by_hand() -> None:
    # log(pi_old / pi_rollout) = 0.5, 0, -0.8 -> ratios 1.648721, 1, 0.449329; truncated at 1.5
    old, rollout = torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1.5, -1.0, -0.2])
    mask = torch.tensor([1, 1, 1])
    lr = mismatch_log_ratio(old, rollout, mask, [2, 1], "token")
    w, cut = tis_weights(lr, clip=1.5)
    assert w.tolist() == pytest.approx([1.5, 1.0, 0.449329], abs=1e-6)
    assert cut.tolist() == [1.0, 0.0, 0.0]
    # sequence level: seq 1 sums 0.5 + 0 -> 1.648721 -> 1.5 on both tokens; seq 2: 0.449329
    w, cut = tis_weights(mismatch_log_ratio(old, rollout, mask, [2, 1], "sequence"), clip=1.5)
    assert w.tolist() == pytest.approx([1.5, 1.5, 0.449329], abs=1e-6)
    assert cut.tolist() == [1.0, 1.0, 0.0]
    # geometric: seq 1 mean 0.25 -> exp(0.25) = 1.284025
    w, _ = tis_weights(mismatch_log_ratio(old, rollout, mask, [2, 1], "geometric"), clip=1.5)
    assert w.tolist() == pytest.approx([1.284025, 1.284025, 0.449329], abs=1e-6)


def test_icepop_by_hand() -> None:
    # ratios 1.648721 (above 1.5: dropped), 1 (kept), 0.449329 (below 0.5: dropped), 0.818731 (kept)
    lr = torch.tensor([0.5, 0.0, -0.8, -0.2])
    w, dropped = icepop_weights(lr, low=0.5, high=1.5)
    assert w.tolist() == pytest.approx([0.0, 1.0, 0.0, math.exp(-0.2)], abs=1e-6)
    assert dropped.tolist() == [1.0, 0.0, 1.0, 0.0]


def test_masked_tokens_do_not_move_sequence_ratios() -> None:
    # a tool token with a wild rollout logprob must not change the sequence-level weight
    old = torch.tensor([-1.0, 0.0, -1.0])
    rollout = torch.tensor([-1.0, -50.0, -1.0])
    lr = mismatch_log_ratio(old, rollout, torch.tensor([1, 0, 1]), [3], "sequence")
    assert lr.tolist() == [0.0, 0.0, 0.0]


def test_topk_reverse_kl_by_hand() -> None:
    # student p = (0.5, 0.25) on the set, teacher q = (0.25, 0.25)
    # renormalised: p~ = (2/3, 1/3), q~ = (1/2, 1/2): 2/3 ln(4/3) + 1/3 ln(2/3) = 0.0566330
    # unnormalised: 0.5 ln 2 - 0.5 + 0.25 + (0 - 0.25 + 0.25) = 0.0965736
    student = torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64))
    teacher = torch.log(torch.tensor([[0.25, 0.25]], dtype=torch.float64))
    renorm = distill_topk_reverse_kl(student, teacher)
    assert renorm.tolist() == pytest.approx([2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(2 / 3)], abs=1e-12)
    plain = distill_topk_reverse_kl(student, teacher, renormalize=False)
    assert plain.tolist() == pytest.approx([0.5 * math.log(2) - 0.25], abs=1e-12)
    # direction: reverse KL(student || teacher), not KL(teacher || student)
    forward = 0.5 * math.log(0.5 / (2 / 3)) + 0.5 * math.log(0.5 / (1 / 3))
    assert abs(renorm.item() - forward) > 1e-3


def test_topk_reverse_kl_is_zero_with_zero_grad_when_student_equals_teacher_and_for_k1() -> None:
    logp = torch.log_softmax(torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.0, -0.3]]), dim=-1)
    for renormalize in (True, False):
        student = logp.clone().requires_grad_(True)
        loss = distill_topk_reverse_kl(student, logp, renormalize=renormalize)
        loss.sum().backward()
        assert loss.abs().max().item() < 1e-6
        assert student.grad is not None and student.grad.abs().max().item() < 1e-6
    # k = 1 renormalised: both distributions are a point mass on the one token: 0 whatever the logprobs
    student = torch.tensor([[-3.0], [-0.1]], requires_grad=True)
    loss = distill_topk_reverse_kl(student, torch.tensor([[-0.2], [-5.0]]))
    loss.sum().backward()
    assert loss.tolist() == [0.0, 0.0] and student.grad is not None and student.grad.abs().max().item() == 0.0
    # k = 1 unnormalised: p ln(p/q) - p + q, d/ds = p (s - t)
    student = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    loss = distill_topk_reverse_kl(student, torch.tensor([[-2.0]], dtype=torch.float64), renormalize=False)
    loss.sum().backward()
    p, q = math.exp(-1.0), math.exp(-2.0)
    assert loss.item() == pytest.approx(p * 1.0 - p + q, abs=1e-12)
    assert student.grad is not None and student.grad.item() == pytest.approx(p * 1.0, abs=1e-12)


def test_topk_reverse_kl_gradient_matches_an_independent_formula_and_finite_differences() -> None:
    gen = torch.Generator().manual_seed(0)
    # student logprobs at the teacher's ids: not normalised over the set (the rest of the vocabulary holds mass)
    student = (torch.randn(4, 5, generator=gen, dtype=torch.float64) - 2.0).requires_grad_(True)
    teacher = torch.randn(4, 5, generator=gen, dtype=torch.float64) - 2.0
    loss = distill_topk_reverse_kl(student, teacher)
    (grad,) = torch.autograd.grad(loss.sum(), student)
    # independent: probabilities, renormalised by division, KL written with logs of ratios
    with torch.no_grad():
        p = student.exp() / student.exp().sum(-1, keepdim=True)
        q = teacher.exp() / teacher.exp().sum(-1, keepdim=True)
        kl = (p * torch.log(p / q)).sum(-1)
        # closed form: dKL/ds_j = p~_j (log p~_j - log q~_j - KL)
        closed = p * (torch.log(p / q) - kl[:, None])
    assert torch.allclose(loss.detach(), kl, atol=1e-12)
    assert torch.allclose(grad, closed, atol=1e-12)
    assert torch.autograd.gradcheck(lambda s: distill_topk_reverse_kl(s, teacher), (student,))
    assert torch.autograd.gradcheck(lambda s: distill_topk_reverse_kl(s, teacher, renormalize=False), (student,))


def test_topk_reverse_kl_keeps_minus_inf_teacher_entries_finite() -> None:
    student = torch.log(torch.tensor([[0.6, 0.3]])).requires_grad_(True)
    loss = distill_topk_reverse_kl(student, torch.tensor([[0.0, -math.inf]]))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and student.grad is not None and torch.isfinite(student.grad).all()
