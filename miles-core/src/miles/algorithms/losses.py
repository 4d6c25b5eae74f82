"""Per-token loss terms: PPO clip (clip-higher, dual clip), GSPO's sequence-level clip, the critic's
clipped value loss, KL estimators, SFT's NLL and the on-policy distillation terms (per sampled token and
over the teacher's top-k).

Every function takes response-token tensors of a micro-batch concatenated (``[T]``) and returns ``[T]``
tensors (plus metric tensors), so that the trainer can aggregate them with any
:data:`~miles.algorithms.base.Aggregation`. Masking is the aggregator's job; functions here only use the
mask where a value depends on other tokens (sequence-level ratios).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

__all__ = [
    "KLEstimator",
    "distill_reverse_kl",
    "distill_topk_reverse_kl",
    "kl_estimate",
    "nll",
    "ppo_clip",
    "sequence_log_ratio",
    "value_loss",
]

KLEstimator = Literal["k1", "k2", "k3"]
"""Estimators of ``KL(pi || ref)`` from one sampled token (Schulman, "Approximating KL divergence"):
``k1 = log pi - log ref``, ``k2 = (log pi - log ref)^2 / 2``, ``k3 = ref/pi - 1 - log(ref/pi)`` (unbiased,
never negative, low variance)."""


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(pi || ref)`` with ``estimator`` (differentiable through ``logprobs``)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        # ref/pi - 1 - log(ref/pi), with log(ref/pi) = -log_ratio; clamp keeps exp finite.
        neg = (-log_ratio).clamp(min=-20.0, max=20.0)
        return neg.exp() - 1.0 - neg
    raise ValueError(f"unknown KL estimator {estimator!r} (expected 'k1', 'k2' or 'k3')")


def ppo_clip(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate, per token, as a loss: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``.

    ``clip_high > clip_low`` is DAPO's clip-higher. ``dual_clip = c`` (> 1) also bounds the loss of
    negative-advantage tokens by ``-A c`` (Ye et al. 2020). Metrics: ``clipfrac`` (the clipped branch was
    taken), ``dual_clipfrac`` and ``ratio``.
    """
    import torch

    ratio = log_ratio.clamp(max=20.0).exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    metrics = {"clipfrac": (loss_clipped > loss_unclipped).float(), "ratio": ratio.detach()}
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual_clipfrac"] = dual.float()
    return loss, metrics


def sequence_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor, response_lengths: list[int]
) -> torch.Tensor:
    """GSPO's per-token log ratio whose value is the sequence's length-normalised log ratio.

    ``log s_i = mean over trained tokens of (log pi - log pi_old)``; token ``t`` gets
    ``sg(log s_i) + log pi_t - sg(log pi_t)``: the value of the sequence ratio with the gradient of each
    token's own logprob (the GSPO-token form, equal to GSPO when advantages are per sequence).
    """
    import torch

    mask = loss_mask.to(logprobs.dtype)
    diff = (logprobs - old_logprobs).detach() * mask
    seq = []
    for d, m, n in zip(
        torch.split(diff, response_lengths), torch.split(mask, response_lengths), response_lengths, strict=True
    ):
        seq.append((d.sum() / m.sum().clamp(min=1.0)).expand(n))
    seq_log = torch.cat(seq) if seq else diff
    return seq_log + logprobs - logprobs.detach()


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, clip: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with
    ``V_clip = V_old + clamp(V - V_old, -clip, clip)`` (plain ``0.5 (V - R)^2`` when ``clip`` is None)."""
    import torch

    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, {}
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), {"value_clipfrac": (clipped > unclipped).float()}


def nll(logprobs: torch.Tensor) -> torch.Tensor:
    """SFT's per-token negative log-likelihood."""
    return -logprobs


def distill_reverse_kl(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """On-policy distillation: a per-token surrogate of ``KL(pi || teacher)`` on sampled tokens.

    Its value is ``log pi_t - log teacher_t`` (the one-sample estimate of the reverse KL), its gradient
    ``(log pi_t - log teacher_t) * grad log pi_t``: the score-function gradient of the reverse KL with the
    per-token advantage ``-(log pi - log teacher)`` (Agarwal et al. 2024; Thinking Machines 2025).
    """
    gap = (logprobs - teacher_logprobs).detach()
    return gap + gap * (logprobs - logprobs.detach())


_TOPK_FLOOR = -1e4
"""Teacher logprobs below this (``-inf`` of masked tokens) are raised to it, so the KL stays finite."""


def distill_topk_reverse_kl(
    student_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor, *, renormalize: bool = True
) -> torch.Tensor:
    """Top-k on-policy distillation: per position, the reverse KL ``KL(student || teacher)`` restricted
    to the teacher's top-k token set ``S``, computed exactly over ``S`` (not sampled).

    :param student_topk_logprobs: ``[T, k]`` the student's ``log p_i`` at the teacher's top-k ids (with grad).
    :param teacher_topk_logprobs: ``[T, k]`` the teacher's ``log q_i`` of the same ids.
    :param renormalize: renormalise both distributions over ``S`` first:
        ``p~_i = p_i / sum_S p``, ``q~_i = q_i / sum_S q`` and ``D = sum_S p~_i (log p~_i - log q~_i)``, a
        true KL between two distributions on ``S`` (>= 0, 0 iff ``p~ == q~``). Without renormalisation the
        generalised KL of the unnormalised masses ``D = sum_S [p_i (log p_i - log q_i) - p_i + q_i]`` (every
        term >= 0, 0 iff ``p_i == q_i`` on ``S``), which also pulls the student's mass on ``S`` towards
        the teacher's.
    :returns: ``[T]`` per-position ``D``; its gradient is the analytic gradient of ``D`` through the
        student's logprobs (no score-function estimate).

    Reverse KL (student first) is mode-seeking: the student is penalised for mass where the teacher has
    little, as in on-policy distillation (Agarwal et al. 2024; Thinking Machines 2025).
    """
    import torch

    dtype = torch.promote_types(student_topk_logprobs.dtype, torch.float32)  # fp32 at least (fp64 stays)
    student = student_topk_logprobs.to(dtype)
    teacher = teacher_topk_logprobs.to(dtype).detach().clamp(min=_TOPK_FLOOR)
    if renormalize:
        log_p = student - torch.logsumexp(student, dim=-1, keepdim=True)
        log_q = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    p = student.exp()
    return (p * (student - teacher) - p + teacher.exp()).sum(-1)
