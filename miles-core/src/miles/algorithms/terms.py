"""The per-token loss terms of policy-gradient algorithms, registered by name.

Two registries, read by :class:`~miles.algorithms.policy.PolicyGradientAlgorithm`:

- :data:`SURROGATES`: the clipped policy surrogate — ``ppo_clip`` (per-token ratio) and ``gspo`` (GSPO's
  length-normalised sequence ratio). An algorithm names one (``surrogate = "gspo"``).
- :data:`TERMS`: terms added to the surrogate, each switched on by its settings — ``kl`` (``kl_coef``,
  unless the KL is in the reward), ``entropy`` (``entropy_coef``), ``sft`` (``sft_coef``), ``distill``
  (``distill_coef``: per sampled token or over the teacher's top-k), ``value`` (``value_coef``: the critic's
  clipped value loss, algorithms with a critic). An algorithm lists the terms it composes.

A term is ``(inputs, settings, algorithm name) -> (per-token loss or None, metrics)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from miles.algorithms.base import LossInputs

if TYPE_CHECKING:
    import torch

__all__ = ["SURROGATES", "TERMS", "Term", "mismatch_weights", "require", "surrogate", "term"]

Metrics = dict[str, "torch.Tensor"]
Term = Callable[[LossInputs, Any, str], "tuple[torch.Tensor | None, Metrics]"]
Surrogate = Callable[[LossInputs, Any, str], "tuple[torch.Tensor, Metrics]"]

SURROGATES: dict[str, Surrogate] = {}
TERMS: dict[str, Term] = {}


def surrogate(name: str) -> Callable[[Surrogate], Surrogate]:
    """Register a policy surrogate under ``name``."""

    def add(function: Surrogate) -> Surrogate:
        if name in SURROGATES:
            raise ValueError(f"policy surrogate {name!r} is registered twice")
        SURROGATES[name] = function
        return function

    return add


def term(name: str) -> Callable[[Term], Term]:
    """Register a loss term under ``name``."""

    def add(function: Term) -> Term:
        if name in TERMS:
            raise ValueError(f"loss term {name!r} is registered twice")
        TERMS[name] = function
        return function

    return add


def require(value: torch.Tensor | None, field: str, algorithm: str, why: str) -> torch.Tensor:
    """``value``, or a ``ValueError`` naming the missing ``LossInputs`` field and why it is needed."""
    if value is None:
        raise ValueError(f"algorithm {algorithm!r}: LossInputs.{field} is required ({why})")
    return value


def _old(inputs: LossInputs) -> torch.Tensor:
    return inputs.old_logprobs if inputs.old_logprobs is not None else inputs.logprobs.detach()


def _clipped(inputs: LossInputs, s: Any, name: str, log_ratio: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    from miles.algorithms.losses import ppo_clip

    advantages = require(inputs.advantages, "advantages", name, "the policy-gradient term")
    return ppo_clip(log_ratio, advantages, clip_low=s.clip_eps_low, clip_high=s.clip_eps_high, dual_clip=s.dual_clip)


@surrogate("ppo_clip")
def ppo_clip_surrogate(inputs: LossInputs, s: Any, name: str) -> tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate with per-token ratios (clip-higher, dual clip)."""
    return _clipped(inputs, s, name, inputs.logprobs - _old(inputs))


@surrogate("gspo")
def gspo_surrogate(inputs: LossInputs, s: Any, name: str) -> tuple[torch.Tensor, Metrics]:
    """GSPO: the clipped surrogate of each sequence's length-normalised ratio."""
    from miles.algorithms.losses import sequence_log_ratio

    log_ratio = sequence_log_ratio(inputs.logprobs, _old(inputs), inputs.loss_mask, inputs.response_lengths)
    return _clipped(inputs, s, name, log_ratio)


def mismatch_weights(inputs: LossInputs, s: Any, name: str) -> tuple[torch.Tensor, Metrics] | None:
    """TIS / IcePop weights of ``pi_old / pi_rollout`` per token (``mismatch_correction``), or ``None``."""
    from miles.algorithms.correction import icepop_weights, mismatch_log_ratio, tis_weights

    if s.mismatch_correction == "none":
        return None
    rollout = require(
        inputs.rollout_logprobs, "rollout_logprobs", name, f"mismatch_correction = {s.mismatch_correction!r}"
    )
    log_ratio = mismatch_log_ratio(_old(inputs), rollout, inputs.loss_mask, inputs.response_lengths, s.mismatch_level)
    if s.mismatch_correction == "tis":
        weights, cut = tis_weights(log_ratio, clip=s.tis_clip)
        return weights, {"tis_weight": weights, "tis_clipfrac": cut}
    weights, dropped = icepop_weights(log_ratio, low=s.icepop_low, high=s.icepop_high)
    return weights, {"icepop_weight": weights, "icepop_maskfrac": dropped}


@term("kl")
def kl_term(inputs: LossInputs, s: Any, name: str) -> tuple[torch.Tensor | None, Metrics]:
    """``kl_coef * KL(pi || ref)`` (the ``kl`` metric whenever reference logprobs are given)."""
    from miles.algorithms.losses import kl_estimate

    in_loss = s.kl_coef > 0.0 and not s.kl_in_reward
    if inputs.ref_logprobs is None:
        if in_loss:
            require(None, "ref_logprobs", name, f"kl_coef = {s.kl_coef}")
        return None, {}
    kl = kl_estimate(inputs.logprobs, inputs.ref_logprobs, s.kl_estimator)
    return (s.kl_coef * kl if in_loss else None), {"kl": kl.detach()}


@term("entropy")
def entropy_term(inputs: LossInputs, s: Any, name: str) -> tuple[torch.Tensor | None, Metrics]:
    """The entropy bonus ``-entropy_coef * H`` (the ``entropy`` metric whenever entropy is given)."""
    loss = None
    if s.entropy_coef > 0.0:
        loss = -s.entropy_coef * require(inputs.entropy, "entropy", name, f"entropy_coef = {s.entropy_coef}")
    return loss, ({"entropy": inputs.entropy.detach()} if inputs.entropy is not None else {})


@term("sft")
def sft_term(inputs: LossInputs, s: Any, name: str) -> tuple[torch.Tensor | None, Metrics]:
    """``sft_coef`` times the NLL of the trained tokens."""
    from miles.algorithms.losses import nll

    return (s.sft_coef * nll(inputs.logprobs) if s.sft_coef > 0.0 else None), {}


@term("distill")
def distill_term(inputs: LossInputs, s: Any, name: str) -> tuple[torch.Tensor | None, Metrics]:
    """``distill_coef`` times the reverse KL to the teacher (``distill_mode``: ``token`` or ``topk``)."""
    from miles.algorithms.losses import distill_reverse_kl, distill_topk_reverse_kl

    if s.distill_coef <= 0.0:
        return None, {}
    why = f"distill_coef = {s.distill_coef}, distill_mode = {s.distill_mode!r}"
    if s.distill_mode == "token":
        teacher = require(inputs.teacher_logprobs, "teacher_logprobs", name, why)
        metric, value = "distill_reverse_kl", distill_reverse_kl(inputs.logprobs, teacher)
    else:
        teacher_topk = require(inputs.teacher_topk_logprobs, "teacher_topk_logprobs", name, why)
        student_topk = require(inputs.student_topk_logprobs, "student_topk_logprobs", name, why)
        if teacher_topk.shape != student_topk.shape or teacher_topk.shape[:1] != inputs.logprobs.shape:
            raise ValueError(
                f"algorithm {name!r}: teacher_topk_logprobs {tuple(teacher_topk.shape)} and "
                f"student_topk_logprobs {tuple(student_topk.shape)} must both be [T, k] with T = "
                f"{inputs.logprobs.shape[0]}"
            )
        metric = "distill_topk_reverse_kl"
        value = distill_topk_reverse_kl(student_topk, teacher_topk, renormalize=s.distill_topk_renormalize)
    return s.distill_coef * value, {metric: value.detach()}


@term("value")
def value_term(inputs: LossInputs, s: Any, name: str) -> tuple[torch.Tensor | None, Metrics]:
    """``value_coef`` times the critic's clipped value loss (when values are given)."""
    from miles.algorithms.losses import value_loss

    if s.value_coef <= 0.0 or inputs.values is None:
        return None, {}
    returns = require(inputs.returns, "returns", name, "the value loss")
    old_values = inputs.old_values if inputs.old_values is not None else inputs.values.detach()
    vloss, vmetrics = value_loss(inputs.values, old_values, returns, clip=s.value_clip)
    return s.value_coef * vloss, {"value_loss": vloss.detach(), **vmetrics}
