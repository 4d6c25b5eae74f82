"""Settings of the built-in algorithms: one shared base (the composable loss terms) and one subclass per
family. Every field's docstring is its reference documentation (``[algorithm] name = "grpo" ...``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from miles.algorithms.base import Aggregation
from miles.algorithms.correction import CorrectionLevel
from miles.algorithms.losses import KLEstimator
from miles.components import ComponentSettings

__all__ = [
    "DAPOSettings",
    "DistillSettings",
    "DrGRPOSettings",
    "GRPOSettings",
    "GSPOSettings",
    "PPOSettings",
    "PolicyLossSettings",
    "RLOOSettings",
    "ReinforcePPSettings",
    "SFTSettings",
]


class PolicyLossSettings(ComponentSettings):
    """Terms every policy-gradient algorithm composes: clipped surrogate, KL, entropy, mismatch correction,
    optional SFT and distillation terms, aggregation and DAPO's reward-side tricks."""

    policy_coef: float = Field(1.0, ge=0.0)
    """Weight of the policy-gradient (surrogate) term; 0 leaves only the other terms (pure distillation)."""
    clip_eps_low: float = Field(0.2, ge=0.0)
    """Lower clip range of the importance ratio: ratios below ``1 - clip_eps_low`` stop pushing down."""
    clip_eps_high: float = Field(0.2, ge=0.0)
    """Upper clip range: ratios above ``1 + clip_eps_high`` stop pushing up (DAPO's clip-higher: 0.28)."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual-clip constant ``c`` (e.g. 3.0): the loss of a negative-advantage token is at most ``-A c``."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Coefficient of ``KL(pi || ref)``; above 0 the trainer computes reference logprobs."""
    kl_estimator: KLEstimator = "k3"
    """One-sample KL estimator: ``k1`` (log ratio), ``k2`` (half squared log ratio), ``k3`` (low variance)."""
    kl_in_reward: bool = False
    """Put the KL penalty into the reward instead of the loss: per token for REINFORCE++ and PPO, summed
    over the response before the group estimator for GRPO-style algorithms."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus: ``entropy_coef * H(pi_t)`` is subtracted from each token's loss."""
    mismatch_correction: Literal["none", "tis", "icepop"] = "none"
    """Train/inference mismatch correction of the policy loss: truncated importance sampling or IcePop masking."""
    mismatch_level: CorrectionLevel = "token"
    """Ratio the correction uses: per token, per sequence (product) or per sequence geometric mean."""
    tis_clip: float = Field(2.0, gt=0.0)
    """TIS: importance weights ``pi_old / pi_rollout`` are truncated at this value."""
    icepop_low: float = Field(0.5, gt=0.0)
    """IcePop: tokens whose ratio ``pi_old / pi_rollout`` is below this are dropped."""
    icepop_high: float = Field(2.0, gt=0.0)
    """IcePop: tokens whose ratio is above this are dropped."""
    sft_coef: float = Field(0.0, ge=0.0)
    """Weight of an added NLL (SFT) term on the trained tokens."""
    distill_coef: float = Field(0.0, ge=0.0)
    """Weight of an added on-policy distillation term (reverse KL to the teacher, see ``distill_mode``)."""
    distill_mode: Literal["token", "topk"] = "token"
    """Distillation term: ``token`` = one-sample reverse-KL estimate on each sampled token (needs
    ``teacher_logprobs``); ``topk`` = the exact reverse KL over the teacher's top-``distill_topk`` tokens at
    each position (needs the teacher's top-k ids and logprobs; the trainer gathers the student's logprobs
    there)."""
    distill_topk: int = Field(8, ge=1)
    """``k`` of ``distill_mode = "topk"``: how many of the teacher's most likely tokens per position."""
    distill_topk_renormalize: bool = True
    """``topk``: renormalise student and teacher over the top-k set (a KL between distributions on it);
    ``False``: the generalised KL of the unnormalised probabilities on the set."""
    loss_aggregation: Aggregation = "token_mean"
    """How per-token losses become the step loss: ``token_mean`` (DAPO), ``seq_mean_token_mean`` (GRPO),
    ``seq_mean_token_sum_norm`` (Dr.GRPO: each sequence's sum over ``max_response_length``)."""
    max_response_length: int = Field(0, ge=0)
    """Generation budget in tokens; the constant of ``seq_mean_token_sum_norm`` and of overlong shaping."""
    dynamic_sampling: bool = False
    """DAPO: train only on groups whose rewards differ (the rollout manager samples more to fill the batch)."""
    overlong_buffer_length: int = Field(0, ge=0)
    """DAPO's soft overlong punishment: the last this-many tokens before ``max_response_length`` cost up
    to ``overlong_penalty_factor`` reward (0 turns it off). Only the policy's tokens count: a multi-turn
    episode's environment and tool tokens do not."""
    overlong_penalty_factor: float = Field(1.0, ge=0.0)
    """Reward lost by a response of ``max_response_length`` tokens or more under overlong shaping."""

    @model_validator(mode="after")
    def _check(self) -> PolicyLossSettings:
        needs_length = self.loss_aggregation == "seq_mean_token_sum_norm" or self.overlong_buffer_length > 0
        if needs_length and self.max_response_length <= 0:
            raise ValueError(
                "max_response_length must be set (> 0) when loss_aggregation is 'seq_mean_token_sum_norm' "
                "or overlong_buffer_length > 0"
            )
        if self.overlong_buffer_length > self.max_response_length > 0:
            raise ValueError("overlong_buffer_length must not exceed max_response_length")
        if self.icepop_low >= self.icepop_high:
            raise ValueError("icepop_low must be below icepop_high")
        return self


class GRPOSettings(PolicyLossSettings):
    """GRPO: group-normalised advantages ``(r - mean) / (std + eps)``."""

    loss_aggregation: Aggregation = "seq_mean_token_mean"
    """How per-token losses become the step loss (GRPO: mean over each sequence, then over sequences)."""
    std_normalize: bool = True
    """Divide by the group's reward standard deviation (Dr.GRPO turns this off)."""
    unbiased_std: bool = True
    """Standard deviation with ``n - 1`` (as ``torch.std``); ``False`` divides by ``n``."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the standard deviation."""


class DrGRPOSettings(GRPOSettings):
    """Dr.GRPO: no std normalisation, each sequence's token sum over a constant."""

    std_normalize: bool = False
    """Divide by the group's reward standard deviation (off in Dr.GRPO)."""
    loss_aggregation: Aggregation = "seq_mean_token_sum_norm"
    """Dr.GRPO: each sequence's token sum divided by ``max_response_length``, mean over sequences."""
    max_response_length: int = Field(1024, ge=1)
    """Generation budget in tokens: Dr.GRPO's normalising constant."""


class DAPOSettings(GRPOSettings):
    """DAPO: clip-higher, token-mean aggregation, dynamic sampling, optional overlong shaping."""

    clip_eps_high: float = Field(0.28, ge=0.0)
    """Upper clip range (DAPO's clip-higher)."""
    loss_aggregation: Aggregation = "token_mean"
    """DAPO: mean over every token of the step."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal."""


class GSPOSettings(GRPOSettings):
    """GSPO: the sequence-level (length-normalised) ratio, clipped with tiny ranges."""

    clip_eps_low: float = Field(3e-4, ge=0.0)
    """Lower clip range of the sequence ratio (GSPO paper: 3e-4)."""
    clip_eps_high: float = Field(4e-4, ge=0.0)
    """Upper clip range of the sequence ratio (GSPO paper: 4e-4)."""


class RLOOSettings(PolicyLossSettings):
    """RLOO: leave-one-out baseline."""


class ReinforcePPSettings(PolicyLossSettings):
    """REINFORCE++: returns (optionally KL-penalised per token) normalised over the whole batch."""

    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount of per-token rewards when ``kl_in_reward`` is on."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the batch standard deviation."""


class PPOSettings(PolicyLossSettings):
    """PPO with a critic and GAE."""

    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount factor of GAE."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """GAE's lambda (1: Monte-Carlo returns minus values; 0: one-step TD)."""
    value_coef: float = Field(0.5, ge=0.0)
    """Weight of the critic's loss in the total loss."""
    value_clip: float | None = Field(0.2, gt=0.0)
    """Clip range of the value update around the old values (``None``: unclipped)."""
    normalize_advantages: bool = True
    """Whiten advantages over the trained tokens of the batch."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the standard deviation when whitening."""


class SFTSettings(ComponentSettings):
    """Supervised fine-tuning: masked NLL."""

    loss_aggregation: Aggregation = "token_mean"
    """How per-token losses become the step loss."""
    max_response_length: int = Field(0, ge=0)
    """The constant of ``seq_mean_token_sum_norm`` aggregation."""

    @model_validator(mode="after")
    def _check(self) -> SFTSettings:
        if self.loss_aggregation == "seq_mean_token_sum_norm" and self.max_response_length <= 0:
            raise ValueError("max_response_length must be set (> 0) when loss_aggregation is 'seq_mean_token_sum_norm'")
        return self


class DistillSettings(GRPOSettings):
    """On-policy distillation: reverse KL to the teacher on the policy's own samples."""

    loss_aggregation: Aggregation = "token_mean"
    """How per-token losses become the step loss."""
    distill_coef: float = Field(1.0, gt=0.0)
    """Weight of the reverse-KL term."""
    policy_coef: float = Field(0.0, ge=0.0)
    """Weight of a reward-driven PPO term with group-normalised advantages (0: pure distillation)."""
