"""Flow-GRPO's stochastic sampler for flow-matching models, with exact per-step Gaussian log-probabilities.

A rectified-flow model predicts a velocity ``v(x_t, t)``; its ODE step from noise level ``s`` to ``s' < s``
is ``x' = x + (s' - s) v``. Flow-GRPO (Liu et al. 2025, eq. 9) turns it into an SDE with the same
marginals, so that each step is a Gaussian policy ``x' ~ N(mu, std^2 I)``::

    sigma_t = eta * sqrt(s / (1 - s))                    (at s = 1: s / (1 - s') instead, as Flow-GRPO)
    mu      = x (1 + sigma_t^2 (s' - s) / (2 s)) + v (1 + sigma_t^2 (1 - s) / (2 s)) (s' - s)
    std     = sigma_t sqrt(s - s')

``eta`` (the noise level) 0 gives back the ODE step. The log-probability of the sampled ``x'`` is the
Gaussian log-density averaged over the latent's elements (Flow-GRPO's convention: the importance ratio is
``exp`` of the per-element mean log-ratio, and the clip range is sized for it). The engine samples with
these functions and the trainer re-scores the recorded steps with the same ones, in float32.

The KL between the policy's and the reference's step Gaussians (same ``std``) is exact:
``KL = mean((mu - mu_ref)^2) / (2 std^2)`` per element.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["gaussian_logprob", "gaussian_mean_kl", "ode_step", "sde_mean_std", "sde_step"]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _rows(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row value ``[B]`` shaped to broadcast over ``like`` (``[B, ...]``), in float32."""
    import torch

    return value.to(device=like.device, dtype=torch.float32).reshape(-1, *([1] * (like.dim() - 1)))


def sde_mean_std(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (``[B, ...]``) and standard deviation (``[B, 1, ...]``) of each row's step Gaussian, float32.

    :param sigma: ``[B]`` noise level of ``latents`` (1 = pure noise); ``sigma_next``: ``[B]`` of the step's
        target (smaller); ``noise_level``: ``[B]`` Flow-GRPO's ``eta``.
    """
    import torch

    x = latents.float()
    v = velocity.float()
    s, s_next, eta = _rows(sigma, x), _rows(sigma_next, x), _rows(noise_level, x)
    dt = s_next - s
    ratio = s / (1.0 - torch.where(s >= 1.0, s_next, s))
    sigma_t = eta * ratio.sqrt()
    mean = x * (1.0 + sigma_t**2 * dt / (2.0 * s)) + v * (1.0 + sigma_t**2 * (1.0 - s) / (2.0 * s)) * dt
    std = sigma_t * (-dt).sqrt()
    return mean, std


def gaussian_logprob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``[B]``: log N(sample; mean, std^2), averaged over each row's elements (float32, differentiable
    through ``mean``)."""
    diff = sample.float() - mean
    logp = -(diff**2) / (2.0 * std**2) - std.log() - _HALF_LOG_2PI
    return logp.flatten(1).mean(dim=1)


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``[B]``: KL(N(mean, std^2) || N(ref_mean, std^2)) per element, averaged over each row's elements."""
    return ((mean - ref_mean.float()) ** 2 / (2.0 * std**2)).flatten(1).mean(dim=1)


def sde_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One stochastic step: ``x' = mu + std * noise`` and its log-probability ``[B]``.

    ``noise`` is standard normal (``[B, ...]``), drawn by the caller from each row's own generator, so a
    trajectory depends on its seed only.
    """
    mean, std = sde_mean_std(latents, velocity, sigma, sigma_next, noise_level)
    nxt = mean + std * noise.float()
    return nxt, gaussian_logprob(nxt, mean, std)


def ode_step(
    latents: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
) -> torch.Tensor:
    """The deterministic Euler step ``x + (s' - s) v`` (``FlowMatchEulerDiscreteScheduler.step``), float32."""
    x = latents.float()
    return x + (_rows(sigma_next, x) - _rows(sigma, x)) * velocity.float()
