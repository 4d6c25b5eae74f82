"""The trainer's ``nn.Linear`` GEMMs on oneDNN (CPU): forward, input gradient and weight gradient.

PyTorch runs a float32 ``F.linear`` on the CPU through MKL's sgemm, which on this project's AMD EPYC hosts
reaches about 200 GFLOP/s where oneDNN's kernel reaches 450-500 (``docs/benchmarks.md``); bfloat16 GEMMs
already go to oneDNN, but under ``torch.autocast`` every forward casts each float32 weight to bfloat16 again
(and each micro-batch's backward casts the weight gradient back), which on a small model costs as much as the
GEMMs. :func:`install_onednn_linears` gives every ``nn.Linear`` of a model a forward through
:class:`_OneDNNLinear`, an autograd function whose three GEMMs call oneDNN directly:

- **float32**: ``y = x Wᵀ + b``, ``∂x = ∂y W``, ``∂W = ∂yᵀ x`` on oneDNN's float32 kernel (equal to ``F.linear``
  to float32 rounding; the order of the K-sum differs);
- **under ``torch.autocast`` (bfloat16)**: the same GEMMs in bfloat16 with float32 accumulation, as autocast's
  ``F.linear`` computes them, but the weight's bfloat16 copy is made once per optimizer step (when the
  parameter's version changes) instead of once per forward; the weight gradient is returned in the
  parameter's dtype (float32 master weights, gradients and AdamW state, as with autocast).

Only plain CPU tensors take this path; anything else (CUDA, a DTensor, an input that needs no GEMM) runs the
module's own forward. Where oneDNN cannot run (a CPU build without it), installation is refused with the
reason. Switched off by ``[train.backend] onednn_linear = false``.
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["install_onednn_linears", "onednn_linear", "onednn_unavailable"]

log = logging.getLogger(__name__)


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` on oneDNN (``x`` 2-D; strided operands are read in place)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def _mm_on_onednn() -> bool:
    """Whether ``torch.mm`` runs bfloat16 matrices on oneDNN here (the CPU has native bfloat16: AVX512-BF16 or
    AMX; elsewhere it takes ATen's own, slower kernel)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _weight_grad(g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``g2ᵀ x2`` (the weight gradient, in the operands' dtype). In bfloat16 through ``torch.mm``, which hands
    oneDNN's matmul the transposed operand as strides: the same sums as :func:`_gemm`, which copies both
    transposes first (on SmolLM2's shapes 8-20% slower, 13 ms of the LM head's 62 on an AMD EPYC)."""
    if g2.dtype == torch.bfloat16 and _mm_on_onednn():
        return torch.mm(g2.t(), x2)
    return _gemm(g2.t(), x2.t())


@functools.cache
def onednn_unavailable() -> str | None:
    """``None`` when oneDNN's linear runs here in float32 and bfloat16 and agrees with ``F.linear``, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(8, 32, generator=g), torch.randn(16, 32, generator=g)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            got, want = _gemm(x.to(dtype), w.to(dtype)).float(), F.linear(x.to(dtype), w.to(dtype)).float()
            if not torch.allclose(got, want, rtol=tol, atol=tol):
                return f"oneDNN's {dtype} linear disagrees with F.linear on a probe"
    except (RuntimeError, NotImplementedError) as exc:
        return f"oneDNN's linear does not run here ({str(exc).splitlines()[0]})"
    return None


class _CastCache:
    """A weight's copy in the compute dtype, rebuilt when the parameter changes (its version counter moves at
    every in-place update: the optimizer step, a weight load)."""

    __slots__ = ("_key", "_value")

    def __init__(self) -> None:
        self._key: tuple[int, int, torch.dtype] | None = None
        self._value: torch.Tensor | None = None

    def get(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (weight._version, weight.data_ptr(), dtype)
        if self._value is None or self._key != key:
            self._value = weight.detach().to(dtype)
            self._key = key
        return self._value


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        w_compute: torch.Tensor,
    ) -> torch.Tensor:
        compute = w_compute.dtype
        x2 = x.reshape(-1, x.shape[-1]).to(compute)
        b = bias.detach().to(compute) if bias is not None else None
        y = _gemm(x2, w_compute, b)
        ctx.save_for_backward(x2, w_compute)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, w = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1]).to(w.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _gemm(g2, w.t()).reshape(*grad.shape[:-1], w.shape[1]).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(g2, x2).to(ctx.w_dtype)
        if ctx.needs_input_grad[2]:
            grad_b = g2.float().sum(0).to(ctx.b_dtype)
        return grad_x, grad_w, grad_b, None


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cache: _CastCache | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its forward and backward GEMMs on oneDNN; under CPU
    ``torch.autocast`` the GEMMs run in the autocast dtype (``cache`` keeps the weight's cast across
    forwards until the weight changes)."""
    compute = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else weight.dtype
    if compute == weight.dtype:
        w_compute = weight.detach()
    else:
        w_compute = cache.get(weight, compute) if cache is not None else weight.detach().to(compute)
    with torch.autocast("cpu", enabled=False):
        return _OneDNNLinear.apply(x, weight, bias, w_compute)


def _takes_onednn(module: nn.Linear, x: torch.Tensor) -> bool:
    weight = module.weight
    return (
        x.device.type == "cpu"
        and type(weight) is nn.Parameter
        and weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and x.numel() > 0
    )


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not _takes_onednn(self, x):
        return F.linear(x, self.weight, self.bias)
    return onednn_linear(x, self.weight, self.bias, self._miles_cast_cache)


def install_onednn_linears(model: nn.Module) -> int:
    """Route the GEMMs of every ``nn.Linear`` (exactly that class: subclasses such as quantized or LoRA layers
    keep their forward, whose inner ``nn.Linear`` is routed) of ``model`` through oneDNN; returns how many.
    Raises ``RuntimeError`` naming the reason where oneDNN cannot run."""
    problem = onednn_unavailable()
    if problem is not None:
        raise RuntimeError(f"[train.backend] onednn_linear: {problem}")
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and not hasattr(module, "_miles_cast_cache"):
            module._miles_cast_cache = _CastCache()
            module.forward = types.MethodType(_forward, module)
            count += 1
    log.info("oneDNN training linears: %d nn.Linear modules route their GEMMs through oneDNN", count)
    return count
