"""Learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch

from miles.settings.model import TrainSettings
from miles_fsdp.optim import build_optimizer, build_scheduler, clip_grad_norm


def test_scheduler_drives_the_optimizer_lr() -> None:
    train = TrainSettings(lr=1e-3, warmup_steps=2, lr_schedule="cosine", min_lr=0.0, num_rollouts=4)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([param], train)
    sched = build_scheduler(opt, train)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3 * 0.5 * (1 + math.cos(math.pi / 2))])


def test_clip_grad_norm_matches_torch() -> None:
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 4.0]), torch.tensor([0.0, 12.0])
    norm = clip_grad_norm([a, b], 6.5)
    assert norm == pytest.approx(13.0)
    torch.testing.assert_close(
        torch.cat([a.grad, b.grad]), torch.tensor([1.5, 0.0, 2.0, 0.0, 6.0]), rtol=1e-6, atol=1e-6
    )
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(1))], 1.0) == 0.0


def test_the_norm_of_float32_gradients_is_their_float64_norm_and_gradients_within_it_are_left_as_they_are() -> None:
    """A SmolLM2-sized embedding gradient (28M float32 elements) and a few small ones: the total norm is the
    float64 norm to 1e-5 (``get_total_norm``'s float32 reduction was 3e-4 off on these), gradients within
    ``max_norm`` keep their bits, and those beyond it are scaled to it."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n, 576)) for n in (49152, 576, 1536)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    want = sum(float(p.grad.double().pow(2).sum()) for p in params) ** 0.5
    kept = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, max_norm=2 * want)
    assert abs(norm - want) / want < 1e-5
    assert all(torch.equal(p.grad, k) for p, k in zip(params, kept, strict=True))
    assert clip_grad_norm(params, max_norm=want / 2) == pytest.approx(want, rel=1e-5)
    scaled = sum(float(p.grad.double().pow(2).sum()) for p in params) ** 0.5
    assert scaled == pytest.approx(want / 2, rel=1e-5)


def test_plain_parameters_step_with_fused_adamw_equal_to_foreach_and_their_versions_move() -> None:
    """Fused AdamW on plain CPU tensors: the update of the default (foreach) path to float32 rounding, and
    each parameter's version counter moves at every step (the fused kernel alone leaves it, and the oneDNN
    linears' bf16 copies key on it: a copy would go stale and the model would stop learning)."""
    from miles_fsdp.optim import build_optimizer

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(300, 17, generator=g), torch.randn(17, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) * 1e-3 for t in start] for _ in range(4)]
    train = TrainSettings(model_path="x", lr=1e-3, weight_decay=0.01)
    results = []
    for fused in (True, False):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = build_optimizer(params, train)
        if not fused:
            opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
        assert bool(opt.defaults.get("fused")) is fused
        for step in grads:
            versions = [p._version for p in params]
            for p, grad in zip(params, step, strict=True):
                p.grad = grad.clone()
            opt.step()
            assert all(p._version > v for p, v in zip(params, versions, strict=True))
        results.append(params)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
