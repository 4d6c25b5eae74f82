"""oneDNN weight packing for the local engine's CPU matmuls (see :mod:`miles.engine.model_runner`)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["PACK_AFTER", "PACK_BATCH", "packing_works", "plain_linear"]


PACK_BATCH = 32
"""Rows the packed layout is tuned for (a decode batch); any number of rows works."""

PACK_AFTER = 4
"""In bfloat16 a weight is packed at its fourth forward of more rows than the row kernel takes since it last
changed; the forwards before run ``F.linear`` on the plain weight, which oneDNN reorders on each call, with the
same bits (:func:`packing_works`). On an AMD EPYC packing SmolLM2's projections took 48 ms and a forward of
8-128 rows on plain weights 8-10 ms more than on packed ones. A GRPO step pushes new weights and then runs two
such forwards (each prompt of the rollout: the second is fed apart, after the system prompt it shares with the first
is cached; the ``probe_unchanged`` probe's 8 rows go to the row kernel), which skip the packing."""


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch/CPU offers oneDNN weight packing for ``dtype`` and it gives ``F.linear``'s result:
    bit for bit in bfloat16 (``F.linear`` runs the same oneDNN GEMM), to float32 rounding in float32
    (``F.linear`` runs MKL's sgemm there; oneDNN sums in another order)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=g).to(dtype)
        x = torch.randn(3, 5, 40, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        want = F.linear(x, w)
        return bool(
            torch.equal(got, want) if dtype == torch.bfloat16 else torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        )
    except (AttributeError, RuntimeError):
        return False


def plain_linear(module: Any) -> bool:
    """An ``nn.Linear`` (not a quantized projection, :mod:`miles.engine.quantized`)."""
    return type(module) is torch.nn.Linear
