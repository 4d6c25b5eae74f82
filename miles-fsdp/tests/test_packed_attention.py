"""``packed_sdpa``: attention over a packed row sequence by sequence gives what each sequence gives alone (and
what ``sdpa`` over the block-diagonal mask gives), gradients included; a shared prompt with its responses as
branches gives what the unshared row gives; what it does not implement is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_fsdp.packed_attention import Segment, packed_layout, packed_sdpa_attention, register_packed_attention

LENGTHS = [7, 12, 7, 3, 12, 1]
"""Repeated lengths (batched into one SDPA call) and unique ones, a one-token sequence among them."""


def test_layout_from_positions() -> None:
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    assert packed_layout(positions) == [Segment(s, s + n, s, 0) for s, n in zip(starts, LENGTHS, strict=True)]
    # a 5-token root and two branches continuing its first 3 tokens, then a new root
    shared = torch.tensor([0, 1, 2, 3, 4, 3, 4, 3, 4, 5, 0, 1])
    assert packed_layout(shared) == [
        Segment(0, 5, 0, 0),
        Segment(5, 7, 0, 3),
        Segment(7, 10, 0, 3),
        Segment(10, 12, 10, 0),
    ]
    with pytest.raises(ValueError, match="its root is shorter"):
        packed_layout(torch.tensor([0, 1, 5, 6]))
    with pytest.raises(ValueError, match="no sequence starts before it"):
        packed_layout(torch.tensor([2, 3]))


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


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_responses_branching_off_a_shared_prompt_score_and_train_as_whole_sequences(tmp_path: Path, arch: str) -> None:
    """Two prompts, five samples: the row holding each prompt once (its other samples' responses as branches)
    gives every response token the logprob and every parameter the gradient of the row of whole sequences."""
    from transformers import AutoModelForCausalLM

    from miles.testing.models import build_tiny_model

    path = build_tiny_model(tmp_path / arch, arch, seed=2)
    name = register_packed_attention()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (9,), generator=g), torch.randint(0, 500, (5,), generator=g)]
    samples = [(0, 6), (0, 6), (0, 3), (1, 4), (1, 4)]
    responses = [torch.randint(0, 500, (n,), generator=g) for _, n in samples]
    # whole: every sample with its own prompt copy; shared: each prompt once, the first sample whole
    whole_ids, whole_pos, whole_keep, shared_ids, shared_pos, shared_keep = [], [], [], [], [], []
    offset = shared_offset = 0
    roots: dict[int, int] = {}
    for (p, n), response in zip(samples, responses, strict=True):
        prompt = prompts[p]
        seq = torch.cat([prompt, response])
        whole_ids.append(seq)
        whole_pos.append(torch.arange(len(seq)))
        whole_keep.append(torch.arange(offset + len(prompt) - 1, offset + len(seq) - 1))
        offset += len(seq)
        if p not in roots:
            roots[p] = shared_offset + len(prompt) - 1
            shared_ids.append(seq)
            shared_pos.append(torch.arange(len(seq)))
            shared_keep.append(torch.arange(shared_offset + len(prompt) - 1, shared_offset + len(seq) - 1))
            shared_offset += len(seq)
        else:
            shared_ids.append(response)
            shared_pos.append(torch.arange(len(prompt), len(seq)))
            own = torch.arange(shared_offset, shared_offset + n - 1)
            shared_keep.append(torch.cat([torch.tensor([roots[p]]), own]))
            shared_offset += n
    targets = torch.cat(responses)
    results = []
    for ids, pos, keep in ((whole_ids, whole_pos, whole_keep), (shared_ids, shared_pos, shared_keep)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=name)
        logits = model(
            input_ids=torch.cat(ids)[None], position_ids=torch.cat(pos)[None], logits_to_keep=torch.cat(keep),
            use_cache=False,
        ).logits[0]  # fmt: skip
        logprobs = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        logprobs.sum().backward()
        results.append((logprobs.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert sum(len(t) for t in shared_ids) < sum(len(t) for t in whole_ids)
    (whole_lp, whole_grads), (shared_lp, shared_grads) = results
    torch.testing.assert_close(shared_lp, whole_lp, rtol=1e-5, atol=1e-5)
    for param, grad in whole_grads.items():
        torch.testing.assert_close(shared_grads[param], grad, rtol=1e-4, atol=1e-5, msg=param)
