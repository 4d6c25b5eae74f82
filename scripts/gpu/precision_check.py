"""GPU check of the low-precision rollout recipes (passed on an H200, 2026-12-04: benchmarks/results/gpu_h200_2026-12-04/).

On a CUDA machine (FP8 ``torch._scaled_mm`` needs compute capability >= 8.9: Ada / Hopper):

1. every format's :class:`~miles.engine.quantized.QuantizedLinear` on CUDA matches the same computation on
   CPU: ``fp8_row`` / ``fp8_tensor`` through ``torch._scaled_mm`` (W8A8) within bf16 rounding of the
   CPU result, the dequantize-then-matmul formats (``fp8_block``, ``mxfp8``, ``nvfp4``) as well;
2. a tiny model served by the local engine runner on ``cuda`` with each ``quantization``, loaded with what
   the recipe pushes, gives logprobs within the recipe's bound of a bf16 CUDA runner on the same weights,
   and ``/weights_checksum``'s per-tensor checksums equal the pushed tensors' (what verification checks).

    python scripts/gpu/precision_check.py        # exits 1 naming the first failing format
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

DEVICE = os.environ.get("MILES_GPU_CHECK_DEVICE", "cuda")
"""Where the checks run: ``cuda``; ``MILES_GPU_CHECK_DEVICE=cpu`` is a dry run of the script on the CPU."""


def main() -> int:
    import torch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    if DEVICE == "cuda":
        print(f"device: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})")
    from miles.engine.model_runner import ModelRunner
    from miles.engine.quantized import QuantizedLinear, _quantize_activation
    from miles.engine.weight_sync import weights_checksum
    from miles.precision.formats import get_format
    from miles.precision.quantized import FP8, MXFP8, NVFP4
    from miles.testing.models import build_tiny_model
    from miles.transport.base import wire_dtype
    from miles.transport.verify import compare_checksums, tensor_checksum

    recipes = {
        "fp8_row": FP8(FP8.Settings(granularity="row")),
        "fp8_tensor": FP8(FP8.Settings(granularity="tensor")),
        "fp8_block": FP8(FP8.Settings()),
        "mxfp8": MXFP8(MXFP8.Settings()),
        "nvfp4": NVFP4(NVFP4.Settings()),
    }
    failures = []
    g = torch.Generator().manual_seed(0)
    for fmt, _ in recipes.items():
        linear = torch.nn.Linear(512, 256, bias=False).to(torch.bfloat16)
        scaled_mm = fmt in ("fp8_row", "fp8_tensor")
        # the reference: the dequantized weight on the CPU, times the activations as W8A8 quantizes them
        # (not the CPU's own _scaled_mm: before torch 2.13 it takes per-tensor scales only)
        cpu = QuantizedLinear(get_format(fmt), linear, use_scaled_mm=False)
        gpu = QuantizedLinear(get_format(fmt), linear.to(DEVICE), use_scaled_mm=scaled_mm)
        x = torch.randn(64, 512, generator=g).to(torch.bfloat16)
        x_ref = x
        if scaled_mm:
            values, scale = _quantize_activation(x, rowwise=fmt == "fp8_row")
            x_ref = (values.float() * scale).to(torch.bfloat16)
        with torch.inference_mode():
            want, got = cpu(x_ref).float(), gpu(x.to(DEVICE)).float().cpu()
        err = float((got - want).abs().max() / want.abs().max())
        ok = err < 2e-2
        print(f"{fmt:11s} linear on {DEVICE} vs cpu: max rel diff {err:.2e} {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"{fmt}: linear differs from CPU by {err:.2e}")

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "llama", "llama", hidden_size=256, intermediate_size=512)
        from safetensors.torch import load_file

        weights = load_file(str(model / "model.safetensors"))
        reference = ModelRunner(model, device=DEVICE, dtype="bfloat16", attention_backend="sdpa")
        prompt = [[3, 17, 42, 99, 7, 64, 5, 11]]
        ref_logits, _ = reference.prefill(0, prompt, [0], [True])
        ref_lp = torch.log_softmax(ref_logits[0], -1)
        for fmt, recipe in recipes.items():
            try:
                runner = ModelRunner(model, device=DEVICE, dtype="bfloat16", attention_backend="sdpa", quantization=fmt)
            except ValueError as exc:
                print(f"{fmt:11s} refused: {exc}")
                failures.append(f"{fmt}: refused on this GPU ({exc})")
                continue
            sent = dict(recipe.rollout_weights(iter(weights.items())))
            runner.load_tensors(sent.items())
            report = weights_checksum(runner.model)
            try:
                wire = {n: tensor_checksum(t.to(wire_dtype(n, t, torch.bfloat16))) for n, t in sent.items()}
                compare_checksums(wire, report["checksums"], engine=fmt, aliases=report["aliases"])
            except Exception as exc:
                failures.append(f"{fmt}: checksums: {exc}")
            logits, _ = runner.prefill(0, prompt, [0], [True])
            lp = torch.log_softmax(logits[0], -1)
            kl = float((lp.exp() * (lp - ref_lp)).sum(-1).abs().max())
            bound = 0.05 if fmt == "nvfp4" else 0.01
            print(
                f"{fmt:11s} engine on {DEVICE}: max KL to bf16 {kl:.2e} (bound {bound}) {'ok' if kl < bound else 'FAIL'}"
            )
            if not kl < bound:
                failures.append(f"{fmt}: KL {kl:.2e} to bf16 over {bound}")
    if DEVICE == "cuda":
        _time_linears(recipes)
    for failure in failures:
        print("FAIL", failure)
    return 1 if failures else 0


def _time_linears(recipes: dict[str, object]) -> None:
    """Each format's linear against bf16 ``F.linear`` at a 7B model's MLP shape (4096 -> 11008), prefill
    (8192 rows) and decode (64 rows): CUDA-event timings, median of 20 after 5 warm-ups."""
    import torch

    from miles.engine.quantized import QuantizedLinear
    from miles.precision.formats import get_format

    linear = torch.nn.Linear(4096, 11008, bias=False, dtype=torch.bfloat16, device="cuda")
    layers = {"bf16": linear}
    for fmt in recipes:
        layers[fmt] = QuantizedLinear(get_format(fmt), linear, use_scaled_mm=fmt in ("fp8_row", "fp8_tensor"))
    for rows in (8192, 64):
        x = torch.randn(rows, 4096, dtype=torch.bfloat16, device="cuda")
        times = {}
        for name, layer in layers.items():
            with torch.inference_mode():
                for _ in range(5):
                    layer(x)
                samples = []
                for _ in range(20):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    layer(x)
                    end.record()
                    torch.cuda.synchronize()
                    samples.append(start.elapsed_time(end))
            times[name] = sorted(samples)[len(samples) // 2]
        for name, ms in times.items():
            tflops = 2 * rows * 4096 * 11008 / (ms * 1e-3) / 1e12
            print(
                f"timing {rows:5d} rows {name:11s} {ms:8.3f} ms  {tflops:6.1f} TFLOP/s  {times['bf16'] / ms:.2f}x bf16"
            )


if __name__ == "__main__":
    sys.exit(main())
