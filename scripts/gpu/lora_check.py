"""GPU check of LoRA serving in the local engine (passed on an H200, 2026-12-04: benchmarks/results/gpu_h200_2026-12-04/).

On one CUDA device, in process: a tiny Qwen2 is served by :class:`~miles.engine.model_runner.ModelRunner`
(float32 on CUDA) with two random PEFT adapters loaded through :class:`~miles.engine.lora.EngineLoras`; one
padded prefill runs three rows (adapter a, adapter b, the base model) and each row's logprobs are compared
with a PEFT forward of that adapter on the same device. Exits non-zero if any differs by more than 1e-4
(TF32 matmuls are switched off).

    python scripts/gpu/lora_check.py          # python scripts/gpu/lora_check.py cpu: a dry run on the CPU
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path


def main() -> None:
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from miles.engine.model_runner import ModelRunner
    from miles.testing.models import build_tiny_model

    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"  # "cpu": a dry run of this script
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    root = Path(tempfile.mkdtemp(prefix="miles-lora-gpu-"))
    model_dir = build_tiny_model(root / "model", "qwen2", seed=0)
    adapters = {}
    for i, name in enumerate(("a", "b")):
        torch.manual_seed(i + 1)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], init_lora_weights=False
        )
        get_peft_model(base, config).save_pretrained(root / name)
        adapters[name] = root / name
    runner = ModelRunner(model_dir, device=device, dtype="float32", attention_backend="sdpa")
    for name, path in adapters.items():
        runner.lora.load(name, path)
    tokens = [5, 17, 33, 48, 91, 120, 7, 250]
    names = ["a", "b", None]
    runner.lora.set_rows(names)
    logits, _ = runner.prefill(0, [tokens] * 3, [0, 0, 0], [True] * 3)
    worst = 0.0
    for name, got in zip(names, logits, strict=True):
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        if name is not None:
            ref = PeftModel.from_pretrained(ref, str(adapters[name])).to(device)
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([tokens], device=device)).logits[0].float()
        assert got is not None
        diff = float((torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max())
        print(f"adapter {name}: max |engine - PEFT| logprob {diff:.2e}")
        worst = max(worst, diff)
    sys.exit(0 if worst <= 1e-4 else 1)


if __name__ == "__main__":
    main()
