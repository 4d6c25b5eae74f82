"""The composable policy-gradient loss every built-in RL algorithm shares.

One micro-batch's per-token loss is the sum of independent terms, each switched on by its settings::

    loss_t = w_t * pg_t                      policy surrogate (PPO clip / GSPO), times the TIS / IcePop weight
           + kl_coef * KL_t                  KL(pi || ref) with the k1 / k2 / k3 estimator (unless in the reward)
           - entropy_coef * H_t              entropy bonus
           + sft_coef * (-log pi_t)          an SFT term
           + distill_coef * D_t              on-policy distillation (reverse KL to the teacher: per sampled
                                             token, or exactly over the teacher's top-k with distill_mode)
           + value_coef * V_t                the critic's clipped value loss (PPO)

Subclasses choose the advantage estimator (:meth:`compute_advantages`) and whether the ratio is per
token or per sequence (:attr:`sequence_ratio`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel

from miles.algorithms.advantages import overlong_penalty
from miles.algorithms.base import Aggregation, Algorithm, AlgorithmNeeds, LossInputs, LossOutput
from miles.algorithms.settings import PolicyLossSettings

if TYPE_CHECKING:
    import torch

    from miles.types import SampleGroup

__all__ = ["PolicyGradientAlgorithm", "require"]

logger = logging.getLogger(__name__)


def require(value: torch.Tensor | None, field: str, algorithm: str, why: str) -> torch.Tensor:
    """``value``, or a ``ValueError`` naming the missing ``LossInputs`` field and why it is needed."""
    if value is None:
        raise ValueError(f"algorithm {algorithm!r}: LossInputs.{field} is required ({why})")
    return value


class PolicyGradientAlgorithm(Algorithm):
    """Shared loss composition and DAPO tricks; subclasses implement :meth:`compute_advantages`."""

    Settings: ClassVar[type[BaseModel]] = PolicyLossSettings
    sequence_ratio: ClassVar[bool] = False
    """Use GSPO's sequence-level (length-normalised) ratio instead of per-token ratios."""
    has_critic: ClassVar[bool] = False
    supports_kl_in_reward: ClassVar[bool] = False
    policy_coef: float = 1.0
    """Weight of the policy-gradient term (distillation may turn it off)."""

    def __init__(self, settings: BaseModel) -> None:
        super().__init__(settings)
        assert isinstance(settings, PolicyLossSettings)
        self.s: PolicyLossSettings = settings
        if settings.kl_in_reward and not self.supports_kl_in_reward:
            raise ValueError(
                f"algorithm {self.name!r} does not support kl_in_reward; "
                "use kl_coef with kl_in_reward = false to add the KL to the loss"
            )

    # -- what the loop must provide -----------------------------------------------------------------
    @property
    def needs(self) -> AlgorithmNeeds:
        s = self.s
        kl = s.kl_coef > 0.0
        return AlgorithmNeeds(
            rollout=True,
            old_logprobs=True,
            ref_logprobs=kl,
            teacher_logprobs=s.distill_coef > 0.0 and s.distill_mode == "token",
            teacher_topk=s.distill_topk if s.distill_coef > 0.0 and s.distill_mode == "topk" else 0,
            values=self.has_critic,
            entropy=s.entropy_coef > 0.0,
            ref_logprobs_for_advantages=kl and s.kl_in_reward,
        )

    @property
    def aggregation(self) -> Aggregation:
        return self.s.loss_aggregation

    @property
    def seq_len_norm(self) -> float:
        return float(self.s.max_response_length) if self.s.max_response_length > 0 else 1.0

    # -- DAPO tricks ---------------------------------------------------------------------------------
    def keep_groups(self, groups: Sequence[SampleGroup]) -> list[bool]:
        """With ``dynamic_sampling``: keep a group only when its rewards are not all equal."""
        if not self.s.dynamic_sampling:
            return [True] * len(groups)
        return [len(set(g.rewards)) > 1 for g in groups]

    def shaped_rewards(self, group: SampleGroup) -> list[float]:
        """The group's rewards plus DAPO's overlong penalty (when ``overlong_buffer_length`` > 0)."""
        rewards = group.rewards
        if self.s.overlong_buffer_length <= 0:
            return rewards
        return [
            r
            + overlong_penalty(
                s.response_length,
                max_length=self.s.max_response_length,
                buffer_length=self.s.overlong_buffer_length,
                factor=self.s.overlong_penalty_factor,
            )
            for r, s in zip(rewards, group.samples, strict=True)
        ]

    # -- the loss ------------------------------------------------------------------------------------
    def policy_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped surrogate per token (before mismatch correction)."""
        from miles.algorithms.losses import ppo_clip, sequence_log_ratio

        s = self.s
        advantages = require(inputs.advantages, "advantages", self.name, "the policy-gradient term")
        old = inputs.old_logprobs if inputs.old_logprobs is not None else inputs.logprobs.detach()
        if self.sequence_ratio:
            log_ratio = sequence_log_ratio(inputs.logprobs, old, inputs.loss_mask, inputs.response_lengths)
        else:
            log_ratio = inputs.logprobs - old
        return ppo_clip(
            log_ratio, advantages, clip_low=s.clip_eps_low, clip_high=s.clip_eps_high, dual_clip=s.dual_clip
        )

    def mismatch_weights(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """TIS / IcePop weights of ``pi_old / pi_rollout`` per token, or ``None`` when off."""
        from miles.algorithms.correction import icepop_weights, mismatch_log_ratio, tis_weights

        s = self.s
        if s.mismatch_correction == "none":
            return None
        rollout = require(
            inputs.rollout_logprobs, "rollout_logprobs", self.name, f"mismatch_correction = {s.mismatch_correction!r}"
        )
        old = inputs.old_logprobs if inputs.old_logprobs is not None else inputs.logprobs.detach()
        log_ratio = mismatch_log_ratio(old, rollout, inputs.loss_mask, inputs.response_lengths, s.mismatch_level)
        if s.mismatch_correction == "tis":
            weights, cut = tis_weights(log_ratio, clip=s.tis_clip)
            return weights, {"tis_weight": weights, "tis_clipfrac": cut}
        weights, dropped = icepop_weights(log_ratio, low=s.icepop_low, high=s.icepop_high)
        return weights, {"icepop_weight": weights, "icepop_maskfrac": dropped}

    def extra_terms(self, inputs: LossInputs) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Terms added to the loss beyond the policy surrogate (KL, entropy, SFT, distillation)."""
        from miles.algorithms.losses import kl_estimate, nll

        s = self.s
        total: torch.Tensor | None = None
        metrics: dict[str, torch.Tensor] = {}

        def add(term: torch.Tensor) -> None:
            nonlocal total
            total = term if total is None else total + term

        if inputs.ref_logprobs is not None:
            kl = kl_estimate(inputs.logprobs, inputs.ref_logprobs, s.kl_estimator)
            metrics["kl"] = kl.detach()
            if s.kl_coef > 0.0 and not s.kl_in_reward:
                add(s.kl_coef * kl)
        elif s.kl_coef > 0.0 and not s.kl_in_reward:
            require(None, "ref_logprobs", self.name, f"kl_coef = {s.kl_coef}")
        if s.entropy_coef > 0.0:
            entropy = require(inputs.entropy, "entropy", self.name, f"entropy_coef = {s.entropy_coef}")
            add(-s.entropy_coef * entropy)
        if inputs.entropy is not None:
            metrics["entropy"] = inputs.entropy.detach()
        if s.sft_coef > 0.0:
            add(s.sft_coef * nll(inputs.logprobs))
        if s.distill_coef > 0.0:
            name, term = self.distill_term(inputs)
            metrics[name] = term.detach()
            add(s.distill_coef * term)
        return total, metrics

    def distill_term(self, inputs: LossInputs) -> tuple[str, torch.Tensor]:
        """The per-token distillation term of ``distill_mode`` and its metric name."""
        from miles.algorithms.losses import distill_reverse_kl, distill_topk_reverse_kl

        s = self.s
        why = f"distill_coef = {s.distill_coef}, distill_mode = {s.distill_mode!r}"
        if s.distill_mode == "token":
            teacher = require(inputs.teacher_logprobs, "teacher_logprobs", self.name, why)
            return "distill_reverse_kl", distill_reverse_kl(inputs.logprobs, teacher)
        teacher_topk = require(inputs.teacher_topk_logprobs, "teacher_topk_logprobs", self.name, why)
        student_topk = require(inputs.student_topk_logprobs, "student_topk_logprobs", self.name, why)
        if teacher_topk.shape != student_topk.shape or teacher_topk.shape[:1] != inputs.logprobs.shape:
            raise ValueError(
                f"algorithm {self.name!r}: teacher_topk_logprobs {tuple(teacher_topk.shape)} and "
                f"student_topk_logprobs {tuple(student_topk.shape)} must both be [T, k] with T = "
                f"{inputs.logprobs.shape[0]}"
            )
        term = distill_topk_reverse_kl(student_topk, teacher_topk, renormalize=s.distill_topk_renormalize)
        return "distill_topk_reverse_kl", term

    def loss(self, inputs: LossInputs) -> LossOutput:
        metrics: dict[str, torch.Tensor] = {}
        total: torch.Tensor | None = None
        if self.policy_coef > 0.0:
            pg, pg_metrics = self.policy_loss(inputs)
            metrics.update(pg_metrics)
            correction = self.mismatch_weights(inputs)
            if correction is not None:
                weights, corr_metrics = correction
                pg = pg * weights
                metrics.update(corr_metrics)
            metrics["pg_loss"] = pg.detach()
            total = self.policy_coef * pg
        extra, extra_metrics = self.extra_terms(inputs)
        metrics.update(extra_metrics)
        if extra is not None:
            total = extra if total is None else total + extra
        if total is None:
            total = inputs.logprobs * 0.0
        return LossOutput(per_token_loss=total, metrics=metrics)
