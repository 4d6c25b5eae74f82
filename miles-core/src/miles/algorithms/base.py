"""The algorithm interface: what an RL objective needs, how it scores groups, and its per-token loss.

The trainer aggregates the per-token loss the algorithm returns with the algorithm's ``aggregation``
over the *whole* step (all micro-batches and ranks), so gradient accumulation is exact whatever the
micro-batching.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from miles.components import Component, SettingsT

if TYPE_CHECKING:
    import torch

    from miles.types import SampleGroup

__all__ = ["AdvantageInputs", "Advantages", "Aggregation", "Algorithm", "AlgorithmNeeds", "LossInputs", "LossOutput"]

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
"""How per-token losses become one number.

- ``token_mean``: sum over every trained token of the step / number of trained tokens (DAPO).
- ``seq_mean_token_mean``: mean over each sequence's tokens, then mean over sequences (GRPO paper).
- ``seq_mean_token_sum_norm``: sum over each sequence's tokens / a constant, mean over sequences (Dr.GRPO).
"""


@dataclass(frozen=True)
class AlgorithmNeeds:
    """What the training loop must compute before :meth:`Algorithm.loss` can run."""

    rollout: bool = True
    """Needs generated samples (``False`` for SFT over a data set)."""
    old_logprobs: bool = True
    """Needs the trainer's logprobs before the update (the PPO ratio's denominator)."""
    ref_logprobs: bool = False
    teacher_logprobs: bool = False
    """Needs the teacher's logprob of each sampled token (per-token distillation)."""
    teacher_topk: int = 0
    """Needs the teacher's top-``k`` ids and logprobs at each response position, and the trainer's
    ``student_topk_logprobs`` at those ids (top-k distillation); 0: not needed."""
    values: bool = False
    entropy: bool = False
    """Needs per-token entropy in :class:`LossInputs` (an entropy bonus)."""
    ref_logprobs_for_advantages: bool = False
    """:meth:`Algorithm.compute_advantages` needs ``ref_logprobs`` (the KL is part of the reward), so the
    loop computes reference logprobs before advantages."""


@dataclass(frozen=True)
class AdvantageInputs:
    """What advantage estimation sees: the step's groups and, shaped like them (``[group][sample]``, one
    tensor per response token), the critic's values and the reference logprobs when the algorithm needs
    them (``needs.values``, ``needs.ref_logprobs_for_advantages``)."""

    groups: Sequence[SampleGroup]
    values: Sequence[Sequence[torch.Tensor]] | None = None
    ref_logprobs: Sequence[Sequence[torch.Tensor]] | None = None


@dataclass
class Advantages:
    """Per-token advantages of every sample (``[group][sample]``, each the sample's response length) and,
    for algorithms with a critic, the critic's targets (``LossInputs.returns``)."""

    advantages: list[list[torch.Tensor]]
    returns: list[list[torch.Tensor]] | None = None


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch: response tokens of its sequences, concatenated (shape ``[T]``;
    ``[T, k]`` for the top-k fields).

    ``response_lengths`` splits them back into sequences (for sequence-level ratios).
    """

    logprobs: torch.Tensor
    loss_mask: torch.Tensor
    response_lengths: list[int]
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None
    """``[T, k]`` the teacher's logprobs of its top-k tokens at each response position."""
    student_topk_logprobs: torch.Tensor | None = None
    """``[T, k]`` the policy's logprobs (``log_softmax(logits / temperature)``, with gradient) of the
    teacher's top-k tokens at each response position."""
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


@dataclass
class LossOutput:
    """The algorithm's loss for one micro-batch.

    ``per_token_loss`` (``[T]``) is aggregated by the trainer with the algorithm's aggregation;
    ``metrics`` are per-token tensors (``[T]``) averaged over trained tokens of the step (clip fractions,
    KL, ratios ...).
    """

    per_token_loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Algorithm(Component[SettingsT], ABC):
    """An RL (or SFT / distillation) objective. Registered with ``miles_register_algorithms``."""

    @property
    def needs(self) -> AlgorithmNeeds:
        """What must be computed before :meth:`loss` (may depend on settings, e.g. a KL coefficient)."""
        return AlgorithmNeeds()

    @property
    def aggregation(self) -> Aggregation:
        """How the trainer turns per-token losses into the step loss (see :mod:`miles.algorithms.aggregation`)."""
        return "token_mean"

    @property
    def seq_len_norm(self) -> float:
        """The constant of ``seq_mean_token_sum_norm`` aggregation (Dr.GRPO: the maximum response length)."""
        return 1.0

    @property
    def zero_advantage_trains_nothing(self) -> bool:
        """Whether a sequence whose trained tokens all have advantage 0 adds nothing to the gradient (its
        per-token loss is the advantage times a finite factor, and no other term is on): the trainer may then
        score it without a backward pass (its metrics still count). ``False`` unless an algorithm says so."""
        return False

    def keep_groups(self, groups: Sequence[SampleGroup]) -> list[bool]:
        """Which groups to train on (dynamic sampling); the rollout manager refills dropped ones."""
        return [True] * len(groups)

    @abstractmethod
    def compute_advantages(self, inputs: AdvantageInputs) -> Advantages:
        """Per-token advantages for each sample of each group (and returns, with a critic)."""

    @abstractmethod
    def loss(self, inputs: LossInputs) -> LossOutput:
        """The per-token loss of one micro-batch."""
