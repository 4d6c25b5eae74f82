from __future__ import annotations

import math

import pytest
import torch

from miles_diffusion.sde import gaussian_logprob, gaussian_mean_kl, ode_step, sde_mean_std, sde_step


def test_the_step_is_flow_grpos_gaussian() -> None:
    torch.manual_seed(0)
    x, v = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    s, s_next, eta = torch.tensor([1.0, 0.6, 0.2]), torch.tensor([0.8, 0.4, 0.0]), torch.full((3,), 0.7)
    mean, std = sde_mean_std(x, v, s, s_next, eta)
    for i in range(3):  # eq. 9 by hand, with s / (1 - s') at s = 1
        si, sn = float(s[i]), float(s_next[i])
        sigma_t = 0.7 * math.sqrt(si / (1 - (sn if si >= 1 else si)))
        dt = sn - si
        expected = x[i] * (1 + sigma_t**2 * dt / (2 * si)) + v[i] * (1 + sigma_t**2 * (1 - si) / (2 * si)) * dt
        assert torch.allclose(mean[i], expected, atol=1e-6)
        assert float(std[i].reshape(-1)[0]) == pytest.approx(sigma_t * math.sqrt(-dt), rel=1e-6)


def test_logprob_is_the_per_element_mean_gaussian_density() -> None:
    torch.manual_seed(1)
    x, mean, std = torch.randn(2, 3, 5), torch.randn(2, 3, 5), torch.tensor([0.3, 1.7]).view(2, 1, 1)
    expected = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x).flatten(1).mean(1)
    assert torch.allclose(gaussian_logprob(x, mean, std), expected, atol=1e-6)
    ref = torch.randn(2, 3, 5)
    kl = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean, std.expand_as(mean)), torch.distributions.Normal(ref, std.expand_as(ref))
    )
    assert torch.allclose(gaussian_mean_kl(mean, ref, std), kl.flatten(1).mean(1), atol=1e-6)


def test_the_sampled_step_is_scored_exactly_and_is_deterministic() -> None:
    x, v = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    s, s_next, eta = torch.tensor([0.9, 0.9]), torch.tensor([0.7, 0.7]), torch.tensor([0.7, 0.7])
    noise = torch.randn(torch.Size([2, 4, 8, 8]), generator=torch.Generator().manual_seed(3))
    nxt, logp = sde_step(x, v, s, s_next, eta, noise)
    mean, std = sde_mean_std(x, v, s, s_next, eta)
    assert torch.equal(logp, gaussian_logprob(nxt, mean, std))
    again, _ = sde_step(x, v, s, s_next, eta, noise.clone())
    assert torch.equal(nxt, again)
    # a small eta approaches the ODE step (FlowMatchEulerDiscreteScheduler.step)
    tiny, _ = sde_mean_std(x, v, s, s_next, torch.full((2,), 1e-4))
    assert torch.allclose(tiny, ode_step(x, v, s, s_next), atol=1e-6)
    assert torch.allclose(ode_step(x, v, s, s_next), x + (0.7 - 0.9) * v, atol=1e-6)
