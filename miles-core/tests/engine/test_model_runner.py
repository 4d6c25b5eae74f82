"""The model runner's prepacked weights (oneDNN layout): ``F.linear``'s results (bit for bit in bfloat16), in
prefill and decode, rebuilt when a weight update changes the parameters; KV buffer sizing; padded and
masked attention against HF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.engine.model_runner import ModelRunner, _packing_works
from miles.engine.packing import PACK_AFTER


def forward(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    runner.fit(1, 1)  # fresh buffers
    runner.ensure(len(prompts), 64)
    logits, _ = runner.prefill(0, prompts, [0] * len(prompts), [True] * len(prompts))
    decoded, _ = runner.decode([5 + i for i in range(len(prompts))], [len(p) for p in prompts])
    return [lg for lg in logits if lg is not None], decoded


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_weights_equal_f_linear_and_follow_weight_updates(
    engine_models: dict[str, Path], arch: str, dtype: str
) -> None:
    """bfloat16: bit for bit ``F.linear`` (the same oneDNN GEMM); float32: ``F.linear`` (MKL) to float32
    rounding."""
    if not _packing_works(getattr(torch, dtype)):
        pytest.skip(f"this CPU/torch has no oneDNN {dtype} weight packing")
    torch.set_num_threads(1)
    runner = ModelRunner(engine_models[arch], dtype=dtype)
    assert runner.pack_weights
    runner.pack_after = 1  # every weight packed at its first forward (the deferral: the test below)
    prompts = [[(7 * i + j) % 400 + 3 for j in range(5 + 3 * i)] for i in range(3)]

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if dtype == "bfloat16" else torch.allclose(a, b, rtol=1e-5, atol=1e-5)

    def both() -> tuple[tuple[list[torch.Tensor], torch.Tensor], tuple[list[torch.Tensor], torch.Tensor]]:
        runner.pack_weights = True
        packed = forward(runner, prompts)
        runner.pack_weights = False
        plain = forward(runner, prompts)
        runner.pack_weights = True
        return packed, plain

    (p_logits, p_dec), (logits, dec) = both()
    assert all(same(a, b) for a, b in zip(p_logits, logits, strict=True))
    assert same(p_dec, dec)
    assert runner._packed  # the packed path really ran
    if arch != "qwen2":
        return
    # a weight update (another checkpoint of the same shapes) is picked up by the packed weights
    runner.load_weights(engine_models["qwen2_b"])
    (p_logits2, p_dec2), (logits2, dec2) = both()
    assert same(p_dec2, dec2) and not same(p_dec2, p_dec)
    assert all(same(a, b) for a, b in zip(p_logits2, logits2, strict=True))
    runner.drop_packed()
    assert not runner._packed


def test_bf16_weights_are_packed_at_their_fourth_prefill_since_they_changed_with_the_same_bits(
    engine_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forwards before run on the plain weights (oneDNN reorders them on each call): a GRPO step's probe
    and prompts after a push skip the packing. float32 packs at once (``F.linear`` rounds otherwise there)."""
    if not _packing_works(torch.bfloat16):
        pytest.skip("this CPU/torch has no oneDNN bfloat16 weight packing")
    torch.set_num_threads(1)
    packs: list[int] = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, b: packs.append(1) or reorder(w, b))
    runner = ModelRunner(engine_models["qwen2"], dtype="bfloat16")
    assert runner.pack_after == PACK_AFTER == 4
    runner._rows_pending = False  # the row limit kept on this machine (a first measurement packs at once)
    prompts = [[(5 * i + j) % 300 + 3 for j in range(12 + 4 * i)] for i in range(2)]  # more rows than the row kernel's

    def prefill() -> list[torch.Tensor]:
        runner.fit(1, 1)
        runner.ensure(len(prompts), 64)
        logits, _ = runner.prefill(0, prompts, [0] * len(prompts), [True] * len(prompts))
        return [lg for lg in logits if lg is not None]

    plain = [prefill() for _ in range(PACK_AFTER - 1)]
    assert not packs and not runner._packed
    packed = prefill()
    assert packs and len(packs) == len(runner._packed)  # each weight once
    assert all(torch.equal(a, b) for run in plain for a, b in zip(run, packed, strict=True))
    count = len(packs)
    prefill()
    assert len(packs) == count  # packed once
    runner.load_weights(engine_models["qwen2_b"])  # changed weights: plain again until the fourth forward
    changed = [prefill() for _ in range(PACK_AFTER - 1)]
    assert len(packs) == count
    assert not torch.equal(changed[0][0], packed[0]) and torch.equal(changed[0][0], changed[1][0])
    assert torch.equal(prefill()[0], changed[0][0]) and len(packs) == 2 * count
    fp32 = ModelRunner(engine_models["qwen2"], dtype="float32")
    assert fp32.pack_after == 1


def test_kv_buffers_are_kept_for_a_steady_workload_and_freed_after_a_long_one(engine_models: dict[str, Path]) -> None:
    runner = ModelRunner(engine_models["qwen2"])
    runner.ensure(8, 100)
    k = runner.k
    runner.fit(8, 100)  # the next batch needs what is there: nothing is reallocated
    assert runner.k is k and (runner.slots, runner.capacity) == (8, 128)
    runner.fit(8, 40)  # a quarter is still kept
    assert runner.k is k
    runner.fit(2, 20)  # over 4x: freed, and the next forward allocates what it needs
    assert runner.k.numel() == 0 and runner.slots == runner.capacity == 0
    logits, _ = runner.prefill(0, [[5, 6, 7]], [0], [True])
    assert logits[0] is not None and logits[0].shape[0] == 3
    assert (runner.slots, runner.capacity) == (1, 4)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_padded_causal_prefill_and_masked_decode_match_hf(engine_models: dict[str, Path], arch: str) -> None:
    """Two prompts of different lengths prefilled from position 0 in one padded, causal forward, then
    decoded together at different positions (additive mask) and alone (no mask): HF's logits."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    runner = ModelRunner(engine_models[arch])
    hf = AutoModelForCausalLM.from_pretrained(engine_models[arch])
    seqs = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24]]
    logits, _ = runner.prefill(0, [s[:-1] for s in seqs], [0, 0], [True, True])
    both, _ = runner.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs])
    alone, _ = runner.decode([30], [len(seqs[0])])  # slot 0 only: one span, no mask
    with torch.no_grad():
        for b, seq in enumerate(seqs):
            ref = hf(torch.tensor([seq])).logits[0]
            assert torch.allclose(logits[b], ref[:-1], atol=1e-5)
            assert torch.allclose(both[b], ref[-1], atol=1e-5)
        ref = hf(torch.tensor([[*seqs[0], 30]])).logits[0, -1]
    assert torch.allclose(alone[0], ref, atol=1e-5)
