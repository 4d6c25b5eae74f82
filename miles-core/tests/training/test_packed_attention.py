"""``packed_sdpa``: attention over a packed row sequence by sequence gives what each sequence gives alone (and
what ``sdpa`` over the block-diagonal mask gives), gradients included; what it does not implement is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.training.packed_attention import packed_sdpa_attention, register_packed_attention, sequence_bounds

LENGTHS = [7, 12, 7, 3, 12, 1]
"""Repeated lengths (batched into one SDPA call) and unique ones, a one-token sequence among them."""


def test_sequence_bounds_from_restarting_positions() -> None:
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    assert sequence_bounds(positions) == [(s, s + n) for s, n in zip(starts, LENGTHS, strict=True)]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_packed_row_scores_and_trains_as_its_sequences_alone(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    from miles.testing.models import build_tiny_model

    path = build_tiny_model(tmp_path / arch, arch, seed=1)  # both use grouped-query attention
    name = register_packed_attention()
    ids = torch.randint(0, 500, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    results = {}
    for impl in ("sdpa", name):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        logits.logsumexp(-1).sum().backward()
        results[impl] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    alone_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    alone = torch.cat(
        [
            alone_model(input_ids=ids[:, s : s + n], use_cache=False).logits
            for s, n in zip(starts, LENGTHS, strict=True)
        ],
        dim=1,
    ).detach()
    packed, grads = results[name]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, results["sdpa"][0], rtol=1e-5, atol=1e-5)
    for param, grad in results["sdpa"][1].items():
        torch.testing.assert_close(grads[param], grad, rtol=1e-4, atol=1e-5, msg=param)


def test_what_it_does_not_implement_is_refused() -> None:
    module = torch.nn.Module()
    q = k = v = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="sliding window"):
        packed_sdpa_attention(module, q, k, v, None, sliding_window=4)
    with pytest.raises(ValueError, match="padding mask"):
        packed_sdpa_attention(module, q, k, v, torch.ones(1, 4))
    with pytest.raises(ValueError, match="one packed row"):
        packed_sdpa_attention(module, torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8), None)
