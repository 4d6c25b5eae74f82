"""Supervised objectives: SFT (masked NLL) and on-policy distillation (reverse KL to a teacher).

Both can also be added to any RL loss through ``sft_coef`` / ``distill_coef`` of the policy-gradient
algorithms (see :mod:`miles.algorithms.policy`).

Distillation comes in two modes (``distill_mode``), both the reverse KL ``KL(pi || teacher)`` on the
policy's own samples:

- ``token``: per sampled token, from the teacher's logprob of that token (``Sample.teacher_logprobs`` /
  ``LossInputs.teacher_logprobs``, ``[T]``): a one-sample estimate with the score-function gradient
  (:func:`~miles.algorithms.losses.distill_reverse_kl`).
- ``topk``: the exact KL over the teacher's ``distill_topk`` most likely tokens at each position
  (:func:`~miles.algorithms.losses.distill_topk_reverse_kl`, optionally renormalised over that set),
  differentiated analytically. The samples carry the teacher's top-k ids and logprobs
  (``Sample.teacher_topk_ids`` / ``teacher_topk_logprobs``); ``AlgorithmNeeds.teacher_topk`` tells the
  trainer to gather the student's logprobs at those ids (``LossInputs.student_topk_logprobs``, ``[T, k]``,
  with gradient) next to the teacher's (``LossInputs.teacher_topk_logprobs``).

The teacher's numbers come from a teacher server (``[rollout.teacher]``, :mod:`miles.rollout.teacher`)
that scores every sample with a scoring-only ``/generate`` request, or from a custom rollout function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel

from miles.algorithms.base import Aggregation, Algorithm, AlgorithmNeeds, LossInputs, LossOutput
from miles.algorithms.group import GRPO
from miles.algorithms.settings import DistillSettings, SFTSettings

if TYPE_CHECKING:
    import torch

    from miles.types import SampleGroup

__all__ = ["SFT", "Distill"]


class SFT(Algorithm):
    """Supervised fine-tuning: per-token negative log-likelihood of the trained tokens."""

    name = "sft"
    Settings: ClassVar[type[BaseModel]] = SFTSettings

    @property
    def needs(self) -> AlgorithmNeeds:
        return AlgorithmNeeds(rollout=False, old_logprobs=False)

    @property
    def aggregation(self) -> Aggregation:
        assert isinstance(self.settings, SFTSettings)
        return self.settings.loss_aggregation

    @property
    def seq_len_norm(self) -> float:
        assert isinstance(self.settings, SFTSettings)
        return float(self.settings.max_response_length) if self.settings.max_response_length > 0 else 1.0

    def compute_advantages(
        self,
        groups: Sequence[SampleGroup],
        values: Sequence[Sequence[torch.Tensor]] | None = None,
        *,
        ref_logprobs: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> list[list[torch.Tensor]]:
        """SFT has no advantages: zeros of each response's length."""
        import torch

        return [[torch.zeros(s.response_length) for s in g.samples] for g in groups]

    def loss(self, inputs: LossInputs) -> LossOutput:
        from miles.algorithms.losses import nll

        loss = nll(inputs.logprobs)
        return LossOutput(per_token_loss=loss, metrics={"nll": loss.detach()})


class Distill(GRPO):
    """On-policy distillation: reverse KL to the teacher's logprobs on the policy's own samples
    (optionally plus a group-normalised PPO term with ``policy_coef``)."""

    name = "distill"
    Settings: ClassVar[type[BaseModel]] = DistillSettings

    def __init__(self, settings: BaseModel) -> None:
        super().__init__(settings)
        assert isinstance(settings, DistillSettings)
        self.policy_coef = settings.policy_coef

    @property
    def needs(self) -> AlgorithmNeeds:
        base = super().needs
        s = self.settings
        assert isinstance(s, DistillSettings)
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
