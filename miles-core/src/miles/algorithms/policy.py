"""The composable policy-gradient algorithm every built-in RL algorithm is an instance of.

One micro-batch's per-token loss is the sum of independent terms, each switched on by its settings::

    loss_t = w_t * pg_t                      policy surrogate (PPO clip / GSPO), times the TIS / IcePop weight
           + kl_coef * KL_t                  KL(pi || ref) with the k1 / k2 / k3 estimator (unless in the reward)
           - entropy_coef * H_t              entropy bonus
           + sft_coef * (-log pi_t)          an SFT term
           + distill_coef * D_t              on-policy distillation (reverse KL to the teacher: per sampled
                                             token, or exactly over the teacher's top-k with distill_mode)
           + value_coef * V_t                the critic's clipped value loss (PPO)

An algorithm is a name, a settings model and three choices picked from registries: the advantage
estimator (:mod:`miles.algorithms.estimators`), the surrogate and the added terms
(:mod:`miles.algorithms.terms`)::

    class GRPO(PolicyGradientAlgorithm[GRPOSettings]):
        name = "grpo"
        estimator = "group_norm"
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar

from miles.algorithms.advantages import overlong_penalty
from miles.algorithms.base import (
    AdvantageInputs,
    Advantages,
    Aggregation,
    Algorithm,
    AlgorithmNeeds,
    LossInputs,
    LossOutput,
)
from miles.algorithms.estimators import get_estimator
from miles.algorithms.settings import PolicyLossSettings
from miles.algorithms.terms import SURROGATES, TERMS, mismatch_weights

if TYPE_CHECKING:
    import torch

    from miles.types import SampleGroup

__all__ = ["PolicyGradientAlgorithm", "PolicyT"]

logger = logging.getLogger(__name__)

PolicyT = TypeVar("PolicyT", bound=PolicyLossSettings)

_ADVANTAGE_LINEAR_SURROGATES = frozenset({"ppo_clip", "gspo"})
"""Built-in surrogates whose per-token loss is the advantage times a factor of the ratio (0 at advantage 0)."""
_BUILTIN_TERMS = frozenset({"kl", "entropy", "sft", "distill"})
"""The built-in added terms, each off at a zero coefficient."""


class PolicyGradientAlgorithm(Algorithm[PolicyT]):
    """A policy-gradient algorithm composed from registered parts (see the module docstring)."""

    estimator: ClassVar[str] = "group_norm"
    """Advantage estimator (:data:`miles.algorithms.estimators.ESTIMATORS`)."""
    surrogate: ClassVar[str] = "ppo_clip"
    """Policy surrogate (:data:`miles.algorithms.terms.SURROGATES`)."""
    terms: ClassVar[tuple[str, ...]] = ("kl", "entropy", "sft", "distill")
    """Terms added to the surrogate, in order (:data:`miles.algorithms.terms.TERMS`)."""
    critic_terms: ClassVar[tuple[str, ...]] = ()
    """Terms of the critic, added last (``("value",)`` for PPO)."""

    def __init__(self, settings: PolicyT) -> None:
        super().__init__(settings)
        for kind, names, registry in (
            ("advantage estimator", (self.estimator,), None),
            ("policy surrogate", (self.surrogate,), SURROGATES),
            ("loss term", (*self.terms, *self.critic_terms), TERMS),
        ):
            for part in names:
                if registry is None:
                    get_estimator(part)
                elif part not in registry:
                    raise ValueError(
                        f"algorithm {self.name!r}: unknown {kind} {part!r} (registered: {', '.join(sorted(registry))})"
                    )

    @property
    def s(self) -> PolicyT:
        """The algorithm's settings (short name used by the loss code)."""
        return self.settings

    # -- what the loop must provide -----------------------------------------------------------------
    @property
    def needs(self) -> AlgorithmNeeds:
        s = self.settings
        kl = s.kl_coef > 0.0
        return AlgorithmNeeds(
            rollout=True,
            old_logprobs=True,
            ref_logprobs=kl,
            teacher_logprobs=s.distill_coef > 0.0 and s.distill_mode == "token",
            teacher_topk=s.distill_topk if s.distill_coef > 0.0 and s.distill_mode == "topk" else 0,
            values=bool(self.critic_terms),
            entropy=s.entropy_coef > 0.0,
            ref_logprobs_for_advantages=kl and s.kl_in_reward,
        )

    @property
    def aggregation(self) -> Aggregation:
        return self.settings.loss_aggregation

    @property
    def seq_len_norm(self) -> float:
        return float(self.settings.max_response_length) if self.settings.max_response_length > 0 else 1.0

    @property
    def zero_advantage_trains_nothing(self) -> bool:
        """``True`` where the loss is the built-in surrogate alone (PPO clip or GSPO, each the advantage times
        the ratio's factor, optionally times the TIS / IcePop weight): no KL in the loss, no entropy bonus, no
        SFT or distillation term, no critic, and neither :meth:`loss` nor the terms replaced by a subclass."""
        s = self.settings
        return (
            type(self).loss is PolicyGradientAlgorithm.loss
            and self.surrogate in _ADVANTAGE_LINEAR_SURROGATES
            and set(self.terms) <= _BUILTIN_TERMS
            and not self.critic_terms
            and (s.kl_coef <= 0.0 or s.kl_in_reward)
            and s.entropy_coef <= 0.0
            and s.sft_coef <= 0.0
            and s.distill_coef <= 0.0
        )

    # -- DAPO tricks ---------------------------------------------------------------------------------
    def keep_groups(self, groups: Sequence[SampleGroup]) -> list[bool]:
        """With ``dynamic_sampling``: keep a group only when its scored samples' rewards are not all equal."""
        if not self.settings.dynamic_sampling:
            return [True] * len(groups)
        return [len({r for r, ok in zip(g.rewards, g.scored, strict=True) if ok}) > 1 for g in groups]

    def shaped_rewards(self, group: SampleGroup) -> list[float]:
        """The group's rewards plus DAPO's overlong penalty (when ``overlong_buffer_length`` > 0).

        A response's length is the tokens the policy generated (``loss_mask`` 1): in a multi-turn episode the
        environment's and tools' tokens between its turns count toward no generation budget.
        """
        s = self.settings
        rewards = group.rewards
        if s.overlong_buffer_length <= 0:
            return rewards
        return [
            r
            + overlong_penalty(
                sum(sample.loss_mask),
                max_length=s.max_response_length,
                buffer_length=s.overlong_buffer_length,
                factor=s.overlong_penalty_factor,
            )
            for r, sample in zip(rewards, group.samples, strict=True)
        ]

    def compute_advantages(self, inputs: AdvantageInputs) -> Advantages:
        rewards = [self.shaped_rewards(group) for group in inputs.groups]
        return get_estimator(self.estimator)(inputs, self.settings, rewards)

    # -- the loss ------------------------------------------------------------------------------------
    def loss(self, inputs: LossInputs) -> LossOutput:
        s, name = self.settings, self.name
        metrics: dict[str, torch.Tensor] = {}
        total: torch.Tensor | None = None
        if s.policy_coef > 0.0:
            pg, pg_metrics = SURROGATES[self.surrogate](inputs, s, name)
            metrics.update(pg_metrics)
            correction = mismatch_weights(inputs, s, name)
            if correction is not None:
                weights, corr_metrics = correction
                pg = pg * weights
                metrics.update(corr_metrics)
            metrics["pg_loss"] = pg.detach()
            total = s.policy_coef * pg
        for group in (self.terms, self.critic_terms):
            extra: torch.Tensor | None = None
            for part in group:
                value, part_metrics = TERMS[part](inputs, s, name)
                metrics.update(part_metrics)
                if value is not None:
                    extra = value if extra is None else extra + value
            if extra is not None:
                total = extra if total is None else total + extra
        if total is None:
            total = inputs.logprobs * 0.0
        return LossOutput(per_token_loss=total, metrics=metrics)
