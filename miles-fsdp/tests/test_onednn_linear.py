"""The oneDNN training linear: the same function and gradients as ``F.linear`` (float32 to rounding; under
bfloat16 autocast as autocast's own ``F.linear``), the weight's bfloat16 copy made once per optimizer step,
and a whole model trained through it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from miles_fsdp.onednn_linear import install_onednn_linears, onednn_linear, onednn_unavailable

pytestmark = pytest.mark.skipif(onednn_unavailable() is not None, reason=f"oneDNN: {onednn_unavailable()}")


def _operands(bias: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 37, 96, generator=g)  # 3-D, a row count no kernel block divides
    w = torch.randn(160, 96, generator=g) / 10
    b = torch.randn(160, generator=g) if bias else None
    return x, w, b


def _grads(fn, x, w, b, upstream):  # type: ignore[no-untyped-def]
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w) + ((b,) if b is not None else ())]
    y = fn(*leaves) if b is not None else fn(*leaves, None)
    (y.float() * upstream).sum().backward()
    return y.detach().float(), [t.grad for t in leaves]


@pytest.mark.parametrize("bias", [False, True])
def test_float32_equals_f_linear_with_its_gradients_to_rounding(bias: bool) -> None:
    x, w, b = _operands(bias)
    upstream = torch.randn(2, 37, 160, generator=torch.Generator().manual_seed(1))
    got, got_grads = _grads(onednn_linear, x, w, b, upstream)
    want, want_grads = _grads(F.linear, x, w, b, upstream)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, a, e in zip(("x", "weight", "bias"), got_grads, want_grads, strict=False):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-4, msg=f"grad of {name}")


@pytest.mark.parametrize("bias", [False, True])
def test_under_bf16_autocast_it_computes_what_autocast_f_linear_computes(bias: bool) -> None:
    x, w, b = _operands(bias)
    upstream = torch.randn(2, 37, 160, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_grads = _grads(onednn_linear, x, w, b, upstream)
        want, want_grads = _grads(F.linear, x, w, b, upstream)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same bf16 GEMM on oneDNN
    for name, a, e in zip(("x", "weight", "bias"), got_grads, want_grads, strict=False):
        assert a.dtype == torch.float32, name  # float32 master weights and their gradients
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2, msg=f"grad of {name}")


def test_the_bf16_copy_of_a_weight_is_made_once_per_update() -> None:
    layer = nn.Linear(96, 160)
    install_onednn_linears(layer)
    cache = layer._miles_cast_cache  # type: ignore[attr-defined]
    x = torch.randn(5, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = layer(x)
        copy = cache._value
        again = layer(x)
        assert cache._value is copy  # not cast again
        torch.testing.assert_close(first, again, rtol=0, atol=0)
        opt = torch.optim.SGD(layer.parameters(), lr=1.0)
        again.float().sum().backward()
        opt.step()  # an in-place update moves the parameter's version
        after = layer(x)
        assert cache._value is not copy
        with torch.autocast("cpu", enabled=False):
            expected = F.linear(x.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16())
        torch.testing.assert_close(after, expected, rtol=0, atol=0)


def test_install_routes_plain_linears_only() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(8, 8), Scaled(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert install_onednn_linears(model) == 2
    assert install_onednn_linears(model) == 0  # idempotent
    assert "forward" not in vars(model[1])


def test_a_model_trained_through_it_matches_f_linear(tmp_path: Path) -> None:
    """A tiny Qwen2 (biases on q/k/v, tied embeddings): loss and every parameter's gradient equal to float32
    rounding with the oneDNN linears and without."""
    from transformers import AutoModelForCausalLM

    from miles.testing.models import build_tiny_model

    path = build_tiny_model(tmp_path / "m", "qwen2", seed=3)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    results = []
    for routed in (False, True):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if routed:
            assert install_onednn_linears(model) > 0
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-3, atol=1e-6, msg=name)
