"""``packed_sdpa``: attention over a packed row sequence by sequence gives what each sequence gives alone (and
what ``sdpa`` over the block-diagonal mask gives), gradients included; a shared prompt with its responses as
branches gives what the unshared row gives; what it does not implement is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_fsdp.packed_attention import (
    Segment,
    VarlenLayout,
    packed_layout,
    packed_sdpa_attention,
    register_packed_attention,
    varlen_keys,
    varlen_layout,
)

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


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records every call that copies a tensor's values to the host (a device sync on CUDA)."""

    READS = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy"})

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_with_the_layout_given_no_layer_reads_the_device_and_the_trainer_gives_it(tmp_path: Path) -> None:
    """The layout of a micro-batch is computed once, on the host, when it is packed (``PackedMicroBatch.
    segments``); with it, attention reads nothing back from the device in any layer (on CUDA, no sync), and the
    model's forward hands it to every layer. Without it, every layer takes the positions back (two reads)."""
    from transformers import AutoModelForCausalLM

    from miles.testing.models import build_tiny_model
    from miles.training.batch import TrainBatch
    from miles_fsdp.microbatch import pack

    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    q = torch.randn(1, 4, positions.shape[1], 8)
    kv = torch.randn(1, 2, positions.shape[1], 8)
    module = torch.nn.Module()
    with _HostReads() as without:
        reference, _ = packed_sdpa_attention(module, q, kv, kv, None, position_ids=positions)
    assert without.reads  # (what the check would see: the layout taken from the device)
    segments = packed_layout(positions)  # (on the host, once per micro-batch)
    with _HostReads() as given:
        out, _ = packed_sdpa_attention(module, q, kv, kv, None, position_ids=positions, packed_segments=segments)
    assert given.reads == [] and torch.equal(out, reference)

    # pack() computes the layout from the host positions; the model passes it down to every layer
    tokens = [list(range(3, 3 + n)) for n in (9, 6, 9)]
    batch = TrainBatch.from_lists(
        tokens=tokens,
        prompt_lengths=[4, 2, 4],
        loss_mask=[[1.0] * (len(t) - p) for t, p in zip(tokens, [4, 2, 4], strict=True)],
    )
    mb = pack(batch, [0, 1, 2], torch.device("cpu"))
    assert mb.segments == packed_layout(mb.position_ids)
    path = build_tiny_model(tmp_path / "qwen2", "qwen2", seed=1)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=register_packed_attention()
    )
    seen: list[object] = []
    import miles_fsdp.packed_attention as packed

    layout = packed.packed_layout
    try:
        packed.packed_layout = lambda p: seen.append(p) or layout(p)  # type: ignore[assignment]
        with_layout = model(input_ids=mb.input_ids, position_ids=mb.position_ids, packed_segments=mb.segments).logits
        assert seen == []  # no layer computed it again
        from_positions = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
        assert len(seen) == model.config.num_hidden_layers
    finally:
        packed.packed_layout = layout  # type: ignore[assignment]
    assert torch.equal(with_layout, from_positions)


def _varlen_on_the_host(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: VarlenLayout
) -> torch.Tensor:
    """What the variable-length flash kernel computes for ``layout`` (its contract: sequence ``i``'s queries
    ``cu_q[i]:cu_q[i+1]`` against keys ``cu_k[i]:cu_k[i+1]``, causal aligned to the bottom right), written with
    one SDPA call per sequence, so the layout can be checked where there is no CUDA kernel."""
    import torch.nn.functional as F

    q, k, v = query[0].transpose(0, 1), varlen_keys(key, layout), varlen_keys(value, layout)
    cu_q, cu_k = layout.cu_q.tolist(), layout.cu_k.tolist()
    outs = []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)[None]
        ki, vi = (t[cu_k[i] : cu_k[i + 1]].transpose(0, 1)[None] for t in (k, v))
        rows, cols = qi.shape[2], ki.shape[2]
        mask = torch.ones(rows, cols, dtype=torch.bool).tril(diagonal=cols - rows)
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)[None]


def test_the_varlen_layout_is_the_rows_sequences_with_their_prompts() -> None:
    """On CUDA the row is one variable-length flash-attention call (``varlen_layout``, made once per
    micro-batch). Its layout, run through the kernel's contract on the host, gives what the per-segment path
    gives for roots and for branches off a shared prompt, with grouped-query heads; the kernel itself (and its
    bottom-right causal alignment) is checked on a GPU by ``scripts/gpu/attention_check.py``."""
    g = torch.Generator().manual_seed(0)
    # two roots of 7 and 5 tokens; three branches: two off the first (prefix 4), one off the second (prefix 3)
    positions = torch.cat(
        [torch.arange(7), torch.arange(4, 9), torch.arange(4, 6), torch.arange(5), torch.arange(3, 7)]
    )
    segments = packed_layout(positions)
    assert [s.prefix_len for s in segments] == [0, 4, 4, 0, 3]
    layout = varlen_layout(segments, "cpu")
    assert layout.cu_q.tolist() == [0, 7, 12, 14, 19, 23] and layout.cu_k.tolist() == [0, 7, 16, 22, 27, 34]
    assert (layout.max_q, layout.max_k, layout.cu_q.dtype) == (7, 9, torch.int32)
    total = positions.numel()
    query = torch.randn(1, 4, total, 8, generator=g)
    key, value = torch.randn(1, 2, total, 8, generator=g), torch.randn(1, 2, total, 8, generator=g)
    module = torch.nn.Module().eval()
    expected, _ = packed_sdpa_attention(module, query, key, value, None, packed_segments=segments)
    torch.testing.assert_close(_varlen_on_the_host(query, key, value, layout).transpose(1, 2), expected.transpose(1, 2))
    roots = varlen_layout(packed_layout(torch.cat([torch.arange(3), torch.arange(6)])), "cpu")
    assert roots.key_index is None and roots.cu_k.tolist() == [0, 3, 9]  # the keys are the row itself
    # on a CPU the trainer gives no varlen layout, and packed_sdpa ignores one: its CUDA kernel does not run here
    again, _ = packed_sdpa_attention(module, query, key, value, None, packed_segments=segments, packed_varlen=layout)
    torch.testing.assert_close(again, expected)


def test_a_micro_batch_on_a_cpu_carries_no_varlen_layout() -> None:
    from miles.training.batch import TrainBatch
    from miles_fsdp.microbatch import pack

    batch = TrainBatch.from_lists(tokens=[[1, 2, 3, 4], [5, 6, 7]], prompt_lengths=[2, 1], loss_mask=[[1, 1], [1, 0]])
    mb = pack(batch, [0, 1], torch.device("cpu"))
    assert mb.varlen is None and [s.end - s.start for s in mb.segments] == [4, 3]


def test_bfloat16_rows_attend_in_float32_on_a_cpu() -> None:
    """On a CPU a bfloat16 row attends in float32 (PyTorch's bfloat16 flash-attention backward there ran ~3x
    slower than float32's): the output is the float32 attention of the same bfloat16 inputs, rounded to bfloat16
    once, and the gradients come back to the inputs in bfloat16."""
    g = torch.Generator().manual_seed(3)
    total = sum(LENGTHS)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    q, k, v = (torch.randn(1, h, total, 16, generator=g).bfloat16().requires_grad_() for h in (4, 2, 2))
    module = torch.nn.Module().eval()
    want, _ = packed_sdpa_attention(module, q.float(), k.float(), v.float(), None, position_ids=positions)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the trainer runs bf16 (autocast would cast SDPA back)
        out, _ = packed_sdpa_attention(module, q, k, v, None, position_ids=positions)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.bfloat16())
    out, _ = packed_sdpa_attention(module, q, k, v, None, position_ids=positions)
    assert torch.equal(out, want.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 rows under autocast (the oneDNN linears' outputs)
        out32, _ = packed_sdpa_attention(module, q.float(), k.float(), v.float(), None, position_ids=positions)
    assert out32.dtype == torch.float32 and torch.equal(out32, want)
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))
