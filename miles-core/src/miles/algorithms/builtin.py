"""The algorithms that ship with miles-core: each a name, a settings model and its choices of estimator,
surrogate and terms (see :mod:`miles.algorithms.policy`); plus SFT.

- ``grpo``: group-normalised advantages with the PPO-clip loss; ``dr_grpo``: no std, each sequence's token
  sum over ``max_response_length``; ``dapo``: clip-higher, token-mean loss, dynamic sampling, optional
  overlong shaping; ``gspo``: the clipped sequence-level ratio; ``rloo``: the leave-one-out baseline;
- ``reinforce_pp`` / ``reinforce_pp_baseline``: REINFORCE++ (Hu et al. 2025), batch-whitened returns;
- ``ppo``: GAE from a critic, plus ``value_coef`` times the clipped value loss;
- ``distill``: on-policy distillation — the reverse KL to a teacher on the policy's own samples
  (``distill_mode``: per sampled token, or exactly over the teacher's top-k), optionally plus a
  group-normalised PPO term (``policy_coef``);
- ``sft``: supervised fine-tuning, the masked NLL of data-set responses (no rollout).

Distillation's two modes, both ``KL(pi || teacher)`` on the policy's own samples: ``token`` uses the
teacher's logprob of each sampled token (``Sample.teacher_logprobs``), a one-sample estimate with the
score-function gradient; ``topk`` is the exact KL over the teacher's ``distill_topk`` most likely tokens
at each position (``Sample.teacher_topk_ids`` / ``teacher_topk_logprobs``; the trainer gathers the
student's logprobs there), differentiated analytically. The teacher's numbers come from a teacher server
(``[rollout.teacher]``, :mod:`miles.rollout.teacher`) or a custom rollout function.
"""

from __future__ import annotations

from miles.algorithms.base import (
    AdvantageInputs,
    Advantages,
    Aggregation,
    Algorithm,
    AlgorithmNeeds,
    LossInputs,
    LossOutput,
)
from miles.algorithms.policy import PolicyGradientAlgorithm
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

__all__ = [
    "ALGORITHMS",
    "DAPO",
    "GRPO",
    "GSPO",
    "PPO",
    "RLOO",
    "SFT",
    "Distill",
    "DrGRPO",
    "ReinforcePP",
    "ReinforcePPBaseline",
]


class GRPO(PolicyGradientAlgorithm[GRPOSettings]):
    """GRPO: group-normalised advantages ``(r - mean) / (std + eps)`` with the PPO-clip loss."""

    name = "grpo"


class DrGRPO(PolicyGradientAlgorithm[DrGRPOSettings]):
    """Dr.GRPO: ``r - mean`` (no std), each sequence's token sum over ``max_response_length``."""

    name = "dr_grpo"


class DAPO(PolicyGradientAlgorithm[DAPOSettings]):
    """DAPO: clip-higher (0.28), token-mean loss, dynamic sampling, optional overlong reward shaping."""

    name = "dapo"


class GSPO(PolicyGradientAlgorithm[GSPOSettings]):
    """GSPO: group-normalised advantages with a clipped sequence-level (length-normalised) ratio."""

    name = "gspo"
    surrogate = "gspo"


class RLOO(PolicyGradientAlgorithm[RLOOSettings]):
    """RLOO: leave-one-out baseline ``r_i - mean_{j != i} r_j`` with the PPO-clip loss."""

    name = "rloo"
    estimator = "rloo"


class ReinforcePP(PolicyGradientAlgorithm[ReinforcePPSettings]):
    """REINFORCE++: returns whitened over the whole batch's trained tokens, PPO-clip loss."""

    name = "reinforce_pp"
    estimator = "reinforce_pp"


class ReinforcePPBaseline(PolicyGradientAlgorithm[ReinforcePPSettings]):
    """REINFORCE++-baseline: group mean subtracted, then whitened over the batch's trained tokens."""

    name = "reinforce_pp_baseline"
    estimator = "reinforce_pp_baseline"


class PPO(PolicyGradientAlgorithm[PPOSettings]):
    """PPO: GAE from the critic's values, PPO-clip loss plus ``value_coef`` times the clipped value loss."""

    name = "ppo"
    estimator = "gae"
    critic_terms = ("value",)


class Distill(PolicyGradientAlgorithm[DistillSettings]):
    """On-policy distillation: reverse KL to the teacher's logprobs on the policy's own samples
    (optionally plus a group-normalised PPO term with ``policy_coef``)."""

    name = "distill"

    @property
    def needs(self) -> AlgorithmNeeds:
        base = super().needs
        s = self.settings
        return AlgorithmNeeds(
            rollout=True,
            # pure distillation needs no PPO ratio; the ratio and TIS / IcePop need pi_old
            old_logprobs=s.policy_coef > 0.0 or s.mismatch_correction != "none",
            ref_logprobs=base.ref_logprobs,
            teacher_logprobs=s.distill_mode == "token",
            teacher_topk=s.distill_topk if s.distill_mode == "topk" else 0,
            values=False,
            entropy=base.entropy,
            ref_logprobs_for_advantages=False,
        )


class SFT(Algorithm[SFTSettings]):
    """Supervised fine-tuning: per-token negative log-likelihood of the trained tokens."""

    name = "sft"

    @property
    def needs(self) -> AlgorithmNeeds:
        return AlgorithmNeeds(rollout=False, old_logprobs=False)

    @property
    def aggregation(self) -> Aggregation:
        return self.settings.loss_aggregation

    @property
    def seq_len_norm(self) -> float:
        return float(self.settings.max_response_length) if self.settings.max_response_length > 0 else 1.0

    def compute_advantages(self, inputs: AdvantageInputs) -> Advantages:
        """SFT has no advantages: zeros of each response's length."""
        import torch

        return Advantages([[torch.zeros(s.response_length) for s in g.samples] for g in inputs.groups])

    def loss(self, inputs: LossInputs) -> LossOutput:
        from miles.algorithms.losses import nll

        loss = nll(inputs.logprobs)
        return LossOutput(per_token_loss=loss, metrics={"nll": loss.detach()})


ALGORITHMS: tuple[type[Algorithm], ...] = (
    GRPO, DrGRPO, DAPO, GSPO, RLOO, ReinforcePP, ReinforcePPBaseline, PPO, SFT, Distill,
)  # fmt: skip
"""Registered by the built-in ``algorithms`` plugin, in this order."""
