"""Advantage estimators as pure functions of rewards (and, for GAE, values).

Group estimators (GRPO, Dr.GRPO, RLOO) turn each group's scalar rewards into one scalar advantage per
sample; :func:`broadcast_to_tokens` spreads it over the sample's response tokens. REINFORCE++ normalises
over every trained token of the batch; GAE (PPO) runs a backward recursion over the trained tokens of each
response with the critic's values.

Conventions, checked by the tests with hand-worked numbers:

- A group of one sample, or a group whose rewards are all equal, gets advantage 0 everywhere.
- A zero-length response gets an empty advantage tensor.
- Tokens with ``loss_mask`` 0 (tool / environment tokens) get advantage 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "broadcast_to_tokens",
    "gae",
    "global_token_normalize",
    "group_normalized",
    "kl_penalized_returns",
    "over_scored",
    "overlong_penalty",
    "rloo",
]


def group_normalized(
    rewards: Sequence[float], *, std_normalize: bool = True, unbiased_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO: ``(r_i - mean) / (std + eps)``; Dr.GRPO (``std_normalize=False``): ``r_i - mean``.

    ``unbiased_std`` divides by ``n - 1`` (``torch.std``'s default, as TRL and slime do); a group of one
    sample has advantage 0.
    """
    n = len(rewards)
    if n == 0:
        return []
    if max(rewards) == min(rewards):
        return [0.0] * n  # exactly 0, not a rounding error of the mean
    mean = sum(rewards) / n
    centered = [r - mean for r in rewards]
    if not std_normalize:
        return centered
    if n == 1:
        return [0.0]
    var = sum(c * c for c in centered) / (n - 1 if unbiased_std else n)
    std = math.sqrt(var)
    return [c / (std + eps) for c in centered]


def over_scored(
    rewards: Sequence[float], scored: Sequence[bool], scalars_of: Callable[[list[float]], list[float]]
) -> list[float]:
    """``scalars_of`` over the scored samples' rewards only (:attr:`~miles.types.SampleGroup.scored`), 0 for the
    others: a sample whose generation or reward failed has no reward, and counting it as 0 would move the
    others' advantages (three correct answers and a failure would look like three above the mean)."""
    values = iter(scalars_of([r for r, ok in zip(rewards, scored, strict=True) if ok]))
    return [next(values) if ok else 0.0 for ok in scored]


def rloo(rewards: Sequence[float]) -> list[float]:
    """REINFORCE leave-one-out: ``r_i - mean_{j != i} r_j`` (``= n / (n - 1) * (r_i - mean)``); 0 for ``n = 1``."""
    n = len(rewards)
    if n <= 1 or max(rewards) == min(rewards):
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def overlong_penalty(length: int, *, max_length: int, buffer_length: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_length - buffer_length`` tokens, then falling
    linearly to ``-factor`` at ``max_length`` (and staying there beyond)."""
    if buffer_length <= 0:
        return 0.0
    expected = max_length - buffer_length
    if length <= expected:
        return 0.0
    return -factor * min(length - expected, buffer_length) / buffer_length


def broadcast_to_tokens(value: float, loss_mask: Sequence[int]) -> torch.Tensor:
    """``value`` on every trained token, 0 on the others (float32, shape ``[len(loss_mask)]``)."""
    import torch

    mask = torch.tensor(list(loss_mask), dtype=torch.float32)
    return mask * value


def kl_penalized_returns(
    reward: float, kl: torch.Tensor, loss_mask: torch.Tensor, *, kl_coef: float, gamma: float = 1.0
) -> torch.Tensor:
    """Per-token returns when the KL is part of the reward (REINFORCE++ style).

    Token rewards are ``-kl_coef * kl_t`` on trained tokens plus ``reward`` on the last trained token;
    the return of token ``t`` is the ``gamma``-discounted sum of the token rewards of trained tokens from
    ``t`` on. Untrained tokens get 0.
    """
    import torch

    mask = loss_mask.to(torch.float32)
    token_rewards = -kl_coef * kl.to(torch.float32) * mask
    idx = torch.nonzero(mask > 0).flatten()
    out = torch.zeros_like(token_rewards)
    if idx.numel() == 0:
        return out
    token_rewards[idx[-1]] += reward
    running = 0.0
    for i in reversed(idx.tolist()):
        running = float(token_rewards[i]) + gamma * running
        out[i] = running
    return out


def global_token_normalize(
    advantages: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor], *, eps: float = 1e-6, center: bool = True
) -> list[torch.Tensor]:
    """REINFORCE++ / PPO whitening: ``(a - mean) / (std + eps)`` over every trained token of the batch.

    ``std`` is the population standard deviation of the trained tokens (as OpenRLHF's ``masked_whiten``
    computes it); untrained tokens stay 0. With ``center=False`` only the scale is changed.
    """
    import torch

    if not advantages:
        return []
    flat = torch.cat([a.to(torch.float32) for a in advantages])
    mask = torch.cat([m.to(torch.float32) for m in loss_masks])
    count = mask.sum()
    if count == 0:
        return [torch.zeros_like(a, dtype=torch.float32) for a in advantages]
    mean = (flat * mask).sum() / count
    var = (((flat - mean) * mask) ** 2).sum() / count
    std = var.sqrt()
    shifted = flat - mean if center else flat
    normed = shifted / (std + eps) * mask
    return list(torch.split(normed, [a.numel() for a in advantages]))


def gae(
    rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the trained tokens of one response.

    :param rewards: ``[T]`` per-token rewards (the scalar reward on the last trained token, plus any KL
        penalty per token).
    :param values: ``[T]`` critic values ``V(s_t)`` before emitting token ``t``.
    :param loss_mask: ``[T]``; untrained tokens (tool output) are skipped: the recursion runs over the
        trained tokens only, and the state after the last one is terminal (value 0).
    :returns: ``(advantages, returns)``, each ``[T]``, 0 on untrained tokens; ``returns = advantages + values``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``; ``A_t = delta_t + gamma * lam * A_{t+1}``.
    """
    import torch

    rewards = rewards.to(torch.float32)
    values = values.detach().to(torch.float32)
    idx = torch.nonzero(loss_mask > 0).flatten().tolist()
    adv = torch.zeros_like(rewards)
    next_value = 0.0
    next_adv = 0.0
    for i in reversed(idx):
        delta = float(rewards[i]) + gamma * next_value - float(values[i])
        next_adv = delta + gamma * lam * next_adv
        adv[i] = next_adv
        next_value = float(values[i])
    mask = (loss_mask > 0).to(torch.float32)
    returns = (adv + values) * mask
    return adv, returns
