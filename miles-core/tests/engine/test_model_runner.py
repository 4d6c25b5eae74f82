"""The model runner's prepacked bfloat16 weights (oneDNN layout on CPUs with native bf16): bit for bit the
``F.linear`` results, in prefill and decode, and rebuilt when a weight update changes the parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.engine.model_runner import ModelRunner, _packing_works


def forward(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    runner.reset_buffers()
    runner.ensure(len(prompts), 64)
    logits, _ = runner.prefill(0, prompts, [0] * len(prompts), [True] * len(prompts))
    decoded, _ = runner.decode([5 + i for i in range(len(prompts))], [len(p) for p in prompts])
    return [lg for lg in logits if lg is not None], decoded


@pytest.mark.skipif(not _packing_works(), reason="this CPU/torch has no native bf16 oneDNN weight packing")
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_bf16_weights_equal_f_linear_and_follow_weight_updates(
    engine_models: dict[str, Path], arch: str
) -> None:
    torch.set_num_threads(1)
    runner = ModelRunner(engine_models[arch], dtype="bfloat16")
    assert runner.pack_weights
    prompts = [[(7 * i + j) % 400 + 3 for j in range(5 + 3 * i)] for i in range(3)]

    def both() -> tuple[tuple[list[torch.Tensor], torch.Tensor], tuple[list[torch.Tensor], torch.Tensor]]:
        runner.pack_weights = True
        packed = forward(runner, prompts)
        runner.pack_weights = False
        plain = forward(runner, prompts)
        runner.pack_weights = True
        return packed, plain

    (p_logits, p_dec), (logits, dec) = both()
    assert all(torch.equal(a, b) for a, b in zip(p_logits, logits, strict=True))
    assert torch.equal(p_dec, dec)
    assert runner._packed  # the packed path really ran
    if arch != "qwen2":
        return
    # a weight update (another checkpoint of the same shapes) is picked up by the packed weights
    runner.load_weights(engine_models["qwen2_b"])
    (p_logits2, p_dec2), (logits2, dec2) = both()
    assert torch.equal(p_dec2, dec2) and not torch.equal(p_dec2, p_dec)
    assert all(torch.equal(a, b) for a, b in zip(p_logits2, logits2, strict=True))
    runner.drop_packed()
    assert not runner._packed
