"""Train / inference mismatch correction: truncated importance sampling (TIS) and IcePop masking.

The engine samples from ``pi_rollout``; the trainer's ``pi_old`` differs (kernels, precision, stale
weights). Both corrections weigh each token's policy loss by a detached function of
``pi_old / pi_rollout``:

- **TIS**: ``min(ratio, clip)`` (Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training").
- **IcePop**: ``ratio`` inside ``[low, high]``, 0 outside (the token is dropped).

``level`` chooses the ratio: ``token`` (each token's own), ``sequence`` (the product over the trained
tokens of the sequence, the true sequence importance weight) or ``geometric`` (the geometric mean of the
token ratios of the sequence, length independent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

__all__ = ["CorrectionLevel", "icepop_weights", "mismatch_log_ratio", "tis_weights"]

CorrectionLevel = Literal["token", "sequence", "geometric"]


def mismatch_log_ratio(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: list[int],
    level: CorrectionLevel,
) -> torch.Tensor:
    """Per-token ``log(pi_old / pi_rollout)`` at ``level`` (detached; sequence levels repeat per token)."""
    import torch

    mask = loss_mask.to(torch.float32)
    diff = (old_logprobs.detach() - rollout_logprobs.detach()).to(torch.float32) * mask
    if level == "token":
        return diff
    if level not in ("sequence", "geometric"):
        raise ValueError(f"unknown correction level {level!r} (expected 'token', 'sequence' or 'geometric')")
    parts = []
    for d, m, n in zip(
        torch.split(diff, response_lengths), torch.split(mask, response_lengths), response_lengths, strict=True
    ):
        total = d.sum()
        if level == "geometric":
            total = total / m.sum().clamp(min=1.0)
        parts.append(total.expand(n))
    return torch.cat(parts) if parts else diff


def tis_weights(log_ratio: torch.Tensor, *, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min(exp(log_ratio), clip), truncated)``: the weights and a 0/1 tensor of where they were cut."""
    import math

    capped = log_ratio.clamp(max=math.log(clip))
    return capped.exp(), (log_ratio > math.log(clip)).float()


def icepop_weights(log_ratio: torch.Tensor, *, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ratio if low <= ratio <= high else 0, masked)``."""
    import math

    inside = (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))
    weights = log_ratio.clamp(max=math.log(high)).exp() * inside.float()
    return weights, (~inside).float()
