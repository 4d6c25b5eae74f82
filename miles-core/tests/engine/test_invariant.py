"""The batch-invariant ops (:mod:`miles.engine.invariant`): a row's bits do not depend on how many rows share the
call, where the row sits, or whether a query is computed in a prefill or a decode step; and the deterministic
engine's model runner, which computes with them, gives a token the same logits alone, in a batch and in a prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.engine import invariant

pytestmark = pytest.mark.skipif(invariant.invariance_problem() is not None, reason="no batch-invariant GEMM here")


@pytest.mark.parametrize(("k", "n"), [(64, 96), (96, 288), (576, 1536), (1536, 576)])
def test_linear_rows_are_the_same_bits_in_every_call(k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k)
    x, w, b = torch.randn(300, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    whole = invariant.linear(x, w, b)
    for rows in (1, 2, 7, 16, 17, 64, 129):
        assert torch.equal(invariant.linear(x[:rows], w, b), whole[:rows]), rows
    for start in (1, 50, 299):  # a row at any position of a call
        assert torch.equal(invariant.linear(x[start : start + 1], w, b), whole[start : start + 1])
    # within float32's bound for a sum of k products (gamma_k times the sum of their magnitudes) of the exact one:
    # oneDNN's sum order is not MKL's (on an AMD EPYC 2e-4 off at k = 1536 where F.linear was 6e-5 off)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    gamma = k * 2**-24 / (1 - k * 2**-24)
    assert ((whole.double() - exact).abs() <= gamma * (x.double().abs() @ w.double().abs().T + b.double().abs())).all()


def test_linear_backward_is_the_plain_gradient() -> None:
    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(*s, generator=g, requires_grad=True) for s in ((37, 64), (48, 64), (48,)))
    invariant.linear(x, w, b).square().sum().backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    torch.nn.functional.linear(x2, w2, b2).square().sum().backward()
    for got, want in ((x.grad, x2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_rms_norm_and_silu_rows_are_the_same_bits_anywhere() -> None:
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(200, 960, generator=g) * 3, torch.randn(960, generator=g)
    norm, act = invariant.rms_norm(x, weight, 1e-6), invariant.silu(x)
    for rows in (1, 3, 33):
        assert torch.equal(invariant.rms_norm(x[:rows], weight, 1e-6), norm[:rows])
    # a strided tensor goes through the element-wise ops' scalar loop, a contiguous one through their vector loop
    wide = torch.randn(200, 1920, generator=g) * 3
    strided, contiguous = wide[:, ::2], wide[:, ::2].contiguous()
    assert torch.equal(invariant.silu(strided), invariant.silu(contiguous))
    assert not torch.equal(torch.nn.functional.silu(strided), torch.nn.functional.silu(contiguous))
    torch.testing.assert_close(act, torch.nn.functional.silu(x))


def _qkv(length: int, heads: int = 6, kv_heads: int = 2, dim: int = 32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(length)
    return (
        torch.randn(1, heads, length, dim, generator=g),
        torch.randn(1, kv_heads, length, dim, generator=g),
        torch.randn(1, kv_heads, length, dim, generator=g),
    )


def test_attention_decode_step_equals_the_prefill_bit_for_bit() -> None:
    q, k, v = _qkv(150)
    prefill = invariant.attention(q, k, v, torch.arange(150)[None], 0.2)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(prefill, ref, rtol=1e-5, atol=1e-5)
    # a decode step over a cache: three requests (this one in slot 1), a longer span, junk past the position
    cache_k, cache_v = torch.randn(3, 2, 256, 32), torch.randn(3, 2, 256, 32)
    cache_k[1, :, :150], cache_v[1, :, :150] = k[0], v[0]
    for pos in (0, 1, 63, 64, 65, 149):
        for span in (pos + 1, 200):
            step = invariant.attention(
                q[:, :, pos : pos + 1].expand(3, -1, -1, -1),
                cache_k[:, :, :span],
                cache_v[:, :, :span],
                torch.full((3, 1), pos),
                0.2,
            )
            assert torch.equal(step[1], prefill[0, :, pos : pos + 1]), (pos, span)
    # a chunk of queries later in the sequence (a chunked prefill)
    chunk = invariant.attention(q[:, :, 100:130], k, v, torch.arange(100, 130)[None], 0.2)
    assert torch.equal(chunk, prefill[:, :, 100:130])


def test_another_key_chunk_changes_the_bits() -> None:
    """The summation order is the key chunk: another chunk size gives other bits (what the true on-policy
    tests perturb to show that their equality can fail)."""
    q, k, v = _qkv(150)
    pos = torch.arange(150)[None]
    assert not torch.equal(invariant.attention(q, k, v, pos, 0.2), invariant.attention(q, k, v, pos, 0.2, chunk=32))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_deterministic_runner_gives_a_token_the_same_logits_alone_batched_and_prefilled(
    arch: str, tmp_path: Path
) -> None:
    from miles.engine.model_runner import ModelRunner
    from miles.testing.models import build_tiny_model

    path = build_tiny_model(tmp_path / arch, arch, seed=3)  # type: ignore[arg-type]
    runner = ModelRunner(path, invariant=True)
    assert runner.invariant
    seqs = [[(7 * i + 3 * s) % 500 + 1 for i in range(90)] for s in range(3)]
    prefills = [runner.prefill(0, [s], [0], [True]) for s in seqs]
    prefilled, routed_prefill = [p[0][0] for p in prefills], [p[1][0] for p in prefills]
    assert all(p is not None for p in prefilled)
    runner.prefill(0, [s[:5] for s in seqs], [0, 0, 0], [False] * 3)  # then a batched decode of all three
    for pos in range(5, 80):
        logits, routed = runner.decode([s[pos] for s in seqs], [pos] * 3)
        for i, want in enumerate(prefilled):
            assert want is not None and torch.equal(logits[i], want[pos]), (i, pos)
            if runner.is_moe:  # each router chose the same experts for the token as in its prefill
                assert routed is not None and torch.equal(routed[i], routed_prefill[i][pos]), (i, pos)
    runner.prefill(1, [seqs[1][:41]], [0], [False])  # alone, in another slot
    logits, _ = runner.decode([seqs[1][41]], [41], first_slot=1)
    assert prefilled[1] is not None and torch.equal(logits[0], prefilled[1][41])


def test_runner_without_invariant_ops_is_not_batch_invariant(tmp_path: Path) -> None:
    """The default runner (packed GEMMs, SDPA) differs between a prefill and a decode step in the last bits, and a
    bfloat16 engine falls back to running each request alone (the replay covers it); so does a float32 MoE
    without the invariant expert blocks (their expert-order ``index_add_`` and plain GEMMs)."""
    from miles.engine.model_runner import ModelRunner
    from miles.testing.models import build_tiny_model

    path = build_tiny_model(tmp_path / "m", "qwen2", seed=3)
    runner = ModelRunner(path, attention_backend="sdpa")
    seq = [(7 * i) % 500 + 1 for i in range(60)]
    prefilled = runner.prefill(0, [seq], [0], [True])[0][0]
    runner.prefill(0, [seq[:5]], [0], [False])
    steps = [runner.decode([seq[p]], [p])[0][0] for p in range(5, 60)]
    assert prefilled is not None and not all(torch.equal(s, prefilled[5 + i]) for i, s in enumerate(steps))
    assert not ModelRunner(path, dtype="bfloat16", invariant=True).invariant
    moe = build_tiny_model(tmp_path / "moe", "qwen3_moe", seed=3)
    assert ModelRunner(moe, invariant=True).invariant
    runner = ModelRunner(moe, attention_backend="sdpa")
    prefilled = runner.prefill(0, [seq], [0], [True])[0][0]
    runner.prefill(0, [seq[:5]], [0], [False])
    steps = [runner.decode([seq[p]], [p])[0][0] for p in range(5, 60)]
    assert prefilled is not None and not all(torch.equal(s, prefilled[5 + i]) for i, s in enumerate(steps))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_block_rows_are_the_same_bits_in_every_call(arch: str, tmp_path: Path) -> None:
    """A token's MoE output (router, experts, Qwen2-MoE's shared expert) does not depend on the other tokens of
    the call, where the model's own block (expert-order ``index_add_`` into a shared buffer, MKL GEMMs) does
    not promise it; the values are the model's to float rounding, and gradients reach every weight."""
    from transformers import AutoModelForCausalLM

    from miles.testing.models import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / arch, arch, seed=4))  # type: ignore[arg-type]
    block = model.model.layers[0].mlp
    x = torch.randn(1, 57, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = block(x)
        assert not torch.equal(block(x[:, 5:6]), plain[:, 5:6])  # the model's own block: a lone token differs
    invariant.install_moe(block)
    with torch.no_grad():
        whole = block(x)
        for rows in ((0, 1), (5, 6), (3, 20), (0, 56), (56, 57)):
            assert torch.equal(block(x[:, rows[0] : rows[1]]), whole[:, rows[0] : rows[1]]), rows
    torch.testing.assert_close(whole, plain, rtol=1e-5, atol=1e-6)
    block(x.requires_grad_()).square().sum().backward()
    assert x.grad is not None and block.gate.weight.grad is not None
    assert (
        float(block.experts.gate_up_proj.grad.abs().sum()) > 0 and float(block.experts.down_proj.grad.abs().sum()) > 0
    )
