"""GPU check of the FSDP trainer's packed attention on CUDA (not run yet: no GPU lent since it was written).

1. The row as one variable-length flash-attention call (``packed_varlen``, made by
   :func:`miles_fsdp.packed_attention.varlen_layout`) equals the per-segment SDPA path on roots and on
   branches off a shared prompt, with grouped-query heads, forward and backward, in bfloat16 within its
   rounding of a float32 reference.
2. With the layout given, the attention queues its work without waiting for the device:
   ``torch.cuda.set_sync_debug_mode("error")`` makes any device-to-host copy inside it an error.
3. A tiny Qwen2 loaded with ``packed_sdpa`` scores a packed row with the varlen layout as it does without.

    python scripts/gpu/attention_check.py        # exits 1 naming the first failing check
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any


def main() -> int:
    import torch

    from miles_fsdp.packed_attention import (
        packed_layout,
        packed_sdpa_attention,
        register_packed_attention,
        varlen_layout,
    )

    if not torch.cuda.is_available():
        print("attention_check: no CUDA device")
        return 1
    device = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    lengths = [(0, 300), (120, 180), (120, 90), (0, 257), (64, 200), (0, 33)]  # (prefix, own) per segment
    positions = torch.cat([torch.arange(p, p + n) for p, n in lengths])
    segments = packed_layout(positions)
    layout = varlen_layout(segments, device)
    total = positions.numel()
    module = torch.nn.Module().eval()
    failures = []

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **extra: Any) -> torch.Tensor:
        return packed_sdpa_attention(module, q, k, v, None, packed_segments=segments, **extra)[0]

    base = [torch.randn(1, h, total, 64, generator=g) for h in (8, 2, 2)]
    ref = [t.to(device).requires_grad_() for t in base]
    reference = attend(*ref)
    reference.float().square().sum().backward()
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
        ins = [t.to(device, dtype).requires_grad_() for t in base]
        flash = attend(*ins, packed_varlen=layout)
        flash.float().square().sum().backward()
        error = (flash.float() - reference).abs().max().item()
        grads = max((a.grad.float() - b.grad).abs().max().item() for a, b in zip(ins, ref, strict=True))
        scale = max(b.grad.abs().max().item() for b in ref)
        print(f"varlen {dtype}: max |out - fp32 per-segment| {error:.2e}, max |grad diff| {grads:.2e} (of {scale:.2e})")
        if error > tol or grads > tol * scale:
            failures.append(f"varlen {dtype}: out {error:.2e} / grad {grads:.2e} beyond {tol}")

    q, k, v = (t.to(device, torch.bfloat16) for t in base)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attend(q, k, v, packed_varlen=layout)
        attend(q, k, v)
        print("no device-to-host copy inside the attention, varlen or per-segment, with the layout given")
    except RuntimeError as exc:
        failures.append(f"a host sync inside the attention: {exc}")
    finally:
        torch.cuda.set_sync_debug_mode(0)

    from transformers import AutoModelForCausalLM

    from miles.testing.models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "qwen2", "qwen2", seed=0, hidden_size=256, num_heads=4, num_kv_heads=2)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, attn_implementation=register_packed_attention()
        ).to(device)
        ids = torch.randint(0, 500, (1, total), generator=g).to(device)
        inputs = {"input_ids": ids, "position_ids": positions[None].to(device), "packed_segments": segments}
        with torch.no_grad():
            plain = model(**inputs, use_cache=False).logits.float()
            flash = model(**inputs, packed_varlen=layout, use_cache=False).logits.float()
        error = (plain - flash).abs().max().item()
        print(f"tiny qwen2 bf16: max |logits varlen - per-segment| {error:.2e}")
        if error > 0.1:
            failures.append(f"tiny qwen2: logits differ by {error:.2e}")
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
