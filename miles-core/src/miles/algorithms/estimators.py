"""Advantage estimators, registered by name (verl's ``core_algos`` registries are the model).

An estimator turns an algorithm's :class:`~miles.algorithms.base.AdvantageInputs` into
:class:`~miles.algorithms.base.Advantages`, given the algorithm's settings and each group's rewards after
reward shaping (DAPO's overlong penalty). Algorithms pick one by name (``estimator = "grpo"``); a new
estimator is a function decorated with :func:`estimator`.

Built in:

- ``group_norm``: GRPO's ``(r - mean) / (std + eps)`` per group (Dr.GRPO: ``std_normalize = false``),
  spread over each sample's trained tokens;
- ``rloo``: the leave-one-out baseline per group;
- ``reinforce_pp`` / ``reinforce_pp_baseline``: REINFORCE++ — per-token returns (KL-penalised when the KL
  is in the reward), whitened over every trained token of the batch, optionally after subtracting the
  group mean reward;
- ``gae``: PPO's generalised advantage estimation from the critic's values, with returns.

With ``kl_in_reward``, group estimators lower each sample's reward by ``kl_coef`` times its summed
per-token KL (rollout policy vs reference) before estimating; per-token estimators put ``-kl_coef * KL_t``
on each token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from miles.algorithms.advantages import (
    broadcast_to_tokens,
    gae,
    global_token_normalize,
    group_normalized,
    kl_penalized_returns,
    over_scored,
    rloo,
)
from miles.algorithms.base import AdvantageInputs, Advantages
from miles.algorithms.losses import KLEstimator, kl_estimate

if TYPE_CHECKING:
    import torch

    from miles.algorithms.settings import PolicyLossSettings
    from miles.types import Sample

__all__ = ["ESTIMATORS", "Estimator", "estimator", "get_estimator", "token_rewards_with_kl"]

Estimator = Callable[[AdvantageInputs, Any, list[list[float]]], Advantages]
"""``(inputs, settings, shaped rewards per group) -> Advantages``."""

ESTIMATORS: dict[str, Estimator] = {}
"""Every registered estimator by name."""


def estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Register an advantage estimator under ``name`` (a name registered twice is an error)."""

    def add(function: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ESTIMATORS[name] = function
        return function

    return add


def get_estimator(name: str) -> Estimator:
    """The estimator registered as ``name``; the error lists the registered ones."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r} (registered: {', '.join(sorted(ESTIMATORS))})"
        ) from None


def _regroup(inputs: AdvantageInputs, flat: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    it = iter(flat)
    return [[next(it) for _ in group.samples] for group in inputs.groups]


def _ref(inputs: AdvantageInputs, g: int, i: int) -> torch.Tensor | None:
    return inputs.ref_logprobs[g][i] if inputs.ref_logprobs is not None else None


def _kl_in_reward(settings: PolicyLossSettings) -> bool:
    return settings.kl_in_reward and settings.kl_coef > 0.0


def _sequence_kl(sample: Sample, ref_logprobs: torch.Tensor, kl: KLEstimator) -> float:
    """Summed per-token KL estimate of ``sample`` between its rollout logprobs and ``ref_logprobs``."""
    import torch

    rollout = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
    mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
    return float((kl_estimate(rollout, ref_logprobs.to(torch.float32), kl) * mask).sum())


def token_rewards_with_kl(
    sample: Sample, ref_logprobs: torch.Tensor | None, settings: PolicyLossSettings, reward: float, gamma: float
) -> torch.Tensor:
    """Per-token returns of ``sample``: ``reward`` broadcast, or KL-penalised returns when the KL is in the reward.

    The KL is estimated between the rollout logprobs (the policy that sampled) and ``ref_logprobs``.
    """
    import torch

    s = settings
    if not _kl_in_reward(s):
        return broadcast_to_tokens(reward, sample.loss_mask)
    if ref_logprobs is None:
        raise ValueError("kl_in_reward needs ref_logprobs in compute_advantages (needs.ref_logprobs_for_advantages)")
    rollout = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
    kl = kl_estimate(rollout, ref_logprobs.to(torch.float32), s.kl_estimator)
    mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
    return kl_penalized_returns(reward, kl, mask, kl_coef=s.kl_coef, gamma=gamma)


def _group_estimator(
    inputs: AdvantageInputs,
    settings: PolicyLossSettings,
    rewards: list[list[float]],
    scalars_of: Callable[[list[float]], list[float]],
) -> Advantages:
    out = []
    kl_in_reward = _kl_in_reward(settings)
    if kl_in_reward and inputs.ref_logprobs is None:
        raise ValueError("kl_in_reward needs ref_logprobs in compute_advantages (needs.ref_logprobs_for_advantages)")
    for g, group in enumerate(inputs.groups):
        shaped = rewards[g]
        if kl_in_reward:
            shaped = [
                r - settings.kl_coef * _sequence_kl(sample, _ref(inputs, g, i), settings.kl_estimator)
                for i, (r, sample) in enumerate(zip(shaped, group.samples, strict=True))
            ]
        scalars = over_scored(shaped, group.scored, scalars_of)
        out.append([broadcast_to_tokens(a, s.loss_mask) for a, s in zip(scalars, group.samples, strict=True)])
    return Advantages(out)


@estimator("group_norm")
def group_norm_estimator(inputs: AdvantageInputs, settings: Any, rewards: list[list[float]]) -> Advantages:
    """GRPO / Dr.GRPO: group-normalised rewards (``std_normalize``, ``unbiased_std``, ``eps``)."""
    return _group_estimator(
        inputs,
        settings,
        rewards,
        lambda r: group_normalized(
            r, std_normalize=settings.std_normalize, unbiased_std=settings.unbiased_std, eps=settings.eps
        ),
    )


@estimator("rloo")
def rloo_estimator(inputs: AdvantageInputs, settings: Any, rewards: list[list[float]]) -> Advantages:
    """RLOO: ``r_i - mean_{j != i} r_j`` per group."""
    return _group_estimator(inputs, settings, rewards, rloo)


def _minus_mean(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def _reinforce_pp(
    inputs: AdvantageInputs, settings: Any, rewards: list[list[float]], *, subtract_group_mean: bool
) -> Advantages:
    import torch

    flat: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    for g, group in enumerate(inputs.groups):
        group_rewards = rewards[g]
        if subtract_group_mean and any(group.scored):
            group_rewards = over_scored(group_rewards, group.scored, _minus_mean)
        for i, (sample, reward) in enumerate(zip(group.samples, group_rewards, strict=True)):
            flat.append(token_rewards_with_kl(sample, _ref(inputs, g, i), settings, reward, settings.gamma))
            masks.append(torch.tensor(sample.loss_mask, dtype=torch.float32))
    return Advantages(_regroup(inputs, global_token_normalize(flat, masks, eps=settings.eps)))


@estimator("reinforce_pp")
def reinforce_pp_estimator(inputs: AdvantageInputs, settings: Any, rewards: list[list[float]]) -> Advantages:
    """REINFORCE++: returns whitened over the whole batch's trained tokens (``gamma``, ``eps``)."""
    return _reinforce_pp(inputs, settings, rewards, subtract_group_mean=False)


@estimator("reinforce_pp_baseline")
def reinforce_pp_baseline_estimator(inputs: AdvantageInputs, settings: Any, rewards: list[list[float]]) -> Advantages:
    """REINFORCE++-baseline: the group mean subtracted, then whitened over the batch's trained tokens."""
    return _reinforce_pp(inputs, settings, rewards, subtract_group_mean=True)


def _gae_token_rewards(sample: Sample, ref: torch.Tensor | None, settings: Any, reward: float) -> torch.Tensor:
    """Per-token rewards for GAE: ``reward`` on the last trained token, ``-kl_coef * KL_t`` when in the reward."""
    import torch

    if _kl_in_reward(settings):
        # gamma = 0 turns the KL-penalised returns into the per-token rewards themselves.
        return token_rewards_with_kl(sample, ref, settings, reward, gamma=0.0)
    mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
    token_rewards = torch.zeros(len(sample.loss_mask), dtype=torch.float32)
    idx = torch.nonzero(mask > 0).flatten()
    if idx.numel():
        token_rewards[idx[-1]] = reward
    return token_rewards


@estimator("gae")
def gae_estimator(inputs: AdvantageInputs, settings: Any, rewards: list[list[float]]) -> Advantages:
    """PPO: GAE(``gamma``, ``lam``) from the critic's values; returns = advantages + values; advantages
    whitened over the batch's trained tokens with ``normalize_advantages``."""
    import torch

    if inputs.values is None:
        raise ValueError("algorithm 'ppo': compute_advantages needs the critic's values (needs.values)")
    advs, rets, masks = [], [], []
    for g, group in enumerate(inputs.groups):
        for i, (sample, reward) in enumerate(zip(group.samples, rewards[g], strict=True)):
            mask = torch.tensor(sample.loss_mask, dtype=torch.float32)
            token_rewards = _gae_token_rewards(sample, _ref(inputs, g, i), settings, reward)
            adv, ret = gae(token_rewards, inputs.values[g][i], mask, gamma=settings.gamma, lam=settings.lam)
            advs.append(adv)
            rets.append(ret)
            masks.append(mask)
    if settings.normalize_advantages:
        advs = global_token_normalize(advs, masks, eps=settings.eps)
    return Advantages(_regroup(inputs, advs), returns=_regroup(inputs, rets))
