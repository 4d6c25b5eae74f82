"""TIS and IcePop as the companion of low-precision rollout: on a real NVFP4 engine against the bf16
trainer's logprobs of the same tokens, the importance ratios ``pi_old / pi_rollout`` move away from 1 far
more than with a bf16 rollout, TIS truncates them at its clip and IcePop drops the tokens outside its band."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao", reason="torchao (miles-core[quant]) is not installed")

from miles.algorithms.correction import icepop_weights, mismatch_log_ratio, tis_weights
from miles.engine.model_runner import ModelRunner
from miles.precision.quantized import NVFP4


def test_tis_and_icepop_on_an_nvfp4_rollout(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "llama", "llama", seed=0, hidden_size=128, intermediate_size=256)
    weights = load_file(str(model / "model.safetensors"))
    tokens = torch.randint(5, 500, (64,), generator=torch.Generator().manual_seed(0)).tolist()

    def engine_logprobs(quantization: str | None) -> torch.Tensor:
        runner = ModelRunner(model, dtype="bfloat16", attention_backend="sdpa", quantization=quantization)
        sent = NVFP4(NVFP4.Settings()).rollout_weights(iter(weights.items())) if quantization else weights.items()
        runner.load_tensors(sent)
        logits, _ = runner.prefill(0, [tokens], [0], [True])
        return torch.log_softmax(logits[0], -1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]

    trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = trainer(torch.tensor([tokens])).logits[0].float()
    old = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    mask = torch.ones_like(old)
    ratios = {}
    for name, quantization in (("bf16", None), ("nvfp4", "nvfp4")):
        ratios[name] = mismatch_log_ratio(old, engine_logprobs(quantization), mask, [len(old)], "token")
    spread = {name: float(r.abs().mean()) for name, r in ratios.items()}
    assert spread["nvfp4"] > 3 * spread["bf16"], spread

    # clip / band at the largest nvfp4 deviation's neighbourhood, so both corrections act on real tokens
    log_ratio = ratios["nvfp4"]
    clip = float(log_ratio.exp().quantile(0.9))
    weights_tis, truncated = tis_weights(log_ratio, clip=clip)
    assert float(weights_tis.max()) <= clip + 1e-6 and 0 < float(truncated.sum()) < len(old)
    assert torch.equal(weights_tis[truncated == 0], log_ratio.exp()[truncated == 0])
    low, high = float(log_ratio.exp().quantile(0.1)), clip
    weights_pop, dropped = icepop_weights(log_ratio, low=low, high=high)
    assert 0 < float(dropped.sum()) < len(old)
    assert torch.all(weights_pop[dropped == 1] == 0)
    assert torch.allclose(weights_pop[dropped == 0], log_ratio.exp()[dropped == 0])
