"""Miles' CPU kernels (built here on first use): decode attention (SDPA's result for every dtype, head dim and
head grouping the engine meets, the KV write it fuses, batch invariance, clear errors), the fused RMSNorm
and rotary steps (HF's modules bit for bit), and the engine's forward on them against PyTorch ops only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from miles.engine import cpu_kernels
from miles.engine.cpu_kernels import KernelUnavailable, decode_attention

TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """fp64 attention of each request over positions 0..pos[b] (K/V already holding the new entries)."""
    b, heads, dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty(b, heads, dim, dtype=torch.float64)
    for i in range(b):
        n = int(pos[i]) + 1
        keys = k[i, :, :n].double().repeat_interleave(heads // kv_heads, dim=0)
        values = v[i, :, :n].double().repeat_interleave(heads // kv_heads, dim=0)
        out[i] = F.scaled_dot_product_attention(q[i].double()[:, None], keys, values, scale=dim**-0.5)[:, 0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (14, 2, 48), (16, 1, 64)])
def test_matches_attention_and_writes_the_new_kv(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> None:
    g = torch.Generator().manual_seed(heads * dim)
    slots, capacity, b = 6, 40, 5
    k_cache = torch.randn(slots, kv_heads, capacity, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, capacity, dim, generator=g).to(dtype)
    q = torch.randn(b, heads, dim, generator=g).to(dtype)
    k_new = torch.randn(b, kv_heads, dim, generator=g).to(dtype)
    v_new = torch.randn(b, kv_heads, dim, generator=g).to(dtype)
    pos = torch.tensor([0, 7, 31, 12, 30])
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out = decode_attention(q, k_cache, v_cache, k_new, v_new, pos, 32, dim**-0.5)
    rows = torch.arange(b)
    assert torch.equal(k_cache[rows, :, pos], k_new) and torch.equal(v_cache[rows, :, pos], v_new)
    before_k[rows, :, pos], before_v[rows, :, pos] = k_new, v_new
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)  # nothing else written
    assert out.shape == (b, heads, dim) and out.dtype == dtype
    ref = reference(q, k_cache, v_cache, pos)
    assert (out.double() - ref).abs().max().item() < TOL[dtype] * max(1.0, ref.abs().max().item())


def test_strided_views_and_batch_invariance() -> None:
    """The engine passes slot ranges of the cache and strided q / k / v: a request's output is the same
    alone (any slot) and in a batch."""
    g = torch.Generator().manual_seed(0)
    layers, slots, kv_heads, capacity, dim, heads = 2, 8, 3, 64, 64, 9
    cache_k = torch.randn(layers, slots, kv_heads, capacity, dim, generator=g).bfloat16()
    cache_v = torch.randn(layers, slots, kv_heads, capacity, dim, generator=g).bfloat16()
    qkv = torch.randn(4, heads + 2 * kv_heads, dim, generator=g).bfloat16()  # like the fused projection
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    pos = torch.tensor([5, 50, 17, 33])
    k2, v2 = cache_k.clone(), cache_v.clone()
    batch = decode_attention(q, cache_k[1, 2:6], cache_v[1, 2:6], k, v, pos, 51, 0.125)
    for i in range(4):
        alone = decode_attention(
            q[i : i + 1],
            k2[1, 2 + i : 3 + i],
            v2[1, 2 + i : 3 + i],
            k[i : i + 1],
            v[i : i + 1],
            pos[i : i + 1],
            int(pos[i]) + 1,
            0.125,
        )
        assert torch.equal(alone[0], batch[i])
    assert torch.equal(k2, cache_k) and torch.equal(v2, cache_v)


def test_bad_input_is_refused_before_anything_is_written() -> None:
    k_cache = torch.zeros(2, 1, 8, 64)
    v_cache = torch.zeros(2, 1, 8, 64)
    q, new = torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    with pytest.raises(RuntimeError, match="position 8 of request 1 outside the span 8"):
        decode_attention(q, k_cache, v_cache, new, new, torch.tensor([0, 8]), 8, 0.125)
    with pytest.raises(RuntimeError, match="span 9 > capacity 8"):
        decode_attention(q, k_cache, v_cache, new, new, torch.tensor([0, 3]), 9, 0.125)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        decode_attention(q.bfloat16(), k_cache, v_cache, new, new, torch.tensor([0, 3]), 4, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        decode_attention(q, k_cache, v_cache, new, new, torch.tensor([0, 3], dtype=torch.int32), 4, 0.125)
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3_moe"])
def test_engine_decode_on_the_kernel_matches_sdpa(engine_models: dict[str, Path], arch: str) -> None:
    from miles.engine.model_runner import ModelRunner

    torch.set_num_threads(1)
    runs = {}
    for backend in ("miles_cpu", "sdpa"):
        runner = ModelRunner(engine_models[arch], attention_backend=backend)
        assert runner.attention_backend == backend
        prompts = [[3, 4, 5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25]]
        runner.prefill(0, [p[:-1] for p in prompts], [0, 0, 0], [False] * 3)
        tokens, positions, steps = [p[-1] for p in prompts], [len(p) - 1 for p in prompts], []
        for _ in range(6):  # different positions per request: the kernel's per-request spans
            logits, _ = runner.decode(tokens, positions)
            steps.append(logits)
            tokens = logits.argmax(-1).tolist()
            positions = [p + 1 for p in positions]
        runs[backend] = torch.stack(steps)
    assert torch.allclose(runs["miles_cpu"], runs["sdpa"], atol=1e-5)


def test_unavailable_kernel_falls_back_or_fails_clearly(
    engine_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from miles.engine.model_runner import ModelRunner

    def unavailable() -> None:
        raise KernelUnavailable("cannot build C++ extensions: no compiler")

    monkeypatch.setattr(cpu_kernels, "load", unavailable)
    assert ModelRunner(engine_models["qwen2"]).attention_backend == "sdpa"
    with pytest.raises(ValueError, match="attention_backend 'miles_cpu': cannot build C\\+\\+ extensions: no compiler"):
        ModelRunner(engine_models["qwen2"], attention_backend="miles_cpu")
    with pytest.raises(ValueError, match="attention_backend: expected one of auto, sdpa, miles_cpu"):
        ModelRunner(engine_models["qwen2"], attention_backend="flash")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rms_norm_and_rotary_match_the_hf_modules(dtype: torch.dtype) -> None:
    """Bit for bit HF's RMSNorm (bfloat16) and rotary embedding (both dtypes); the float32 norm to float32
    rounding (its sum of squares runs in another order). The residual add happens in place."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    ops = cpu_kernels.load()
    g = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    x = (3 * torch.randn(4, 5, 96, generator=g)).to(dtype)
    delta = torch.randn(4, 5, 96, generator=g).to(dtype)
    want_x = x + delta
    want = norm(want_x)
    got = ops.rms_norm(x, delta, norm.weight, norm.variance_epsilon)
    assert torch.equal(x, want_x)  # updated in place
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    without = ops.rms_norm(x.clone(), None, norm.weight, norm.variance_epsilon)
    assert (
        torch.equal(without, norm(x))
        if dtype == torch.bfloat16
        else torch.allclose(without, norm(x), rtol=1e-6, atol=1e-6)
    )

    qkv = torch.randn(4, 5, 7, 32, generator=g).to(dtype)  # [B, T, heads, head_dim], a strided slice below
    cos, sin = torch.randn(4, 5, 32, generator=g).to(dtype), torch.randn(4, 5, 32, generator=g).to(dtype)
    rotated = ops.rotary(qkv[:, :, 1:6], cos, sin)
    q, k = apply_rotary_pos_emb(qkv[:, :, 1:4].transpose(1, 2), qkv[:, :, 4:6].transpose(1, 2), cos, sin)
    assert torch.equal(rotated[:, :, :3].transpose(1, 2), q) and torch.equal(rotated[:, :, 3:].transpose(1, 2), k)
    with pytest.raises(RuntimeError, match="rms_norm: weight must be"):
        ops.rms_norm(x, None, norm.weight[:10], 1e-5)
    with pytest.raises(RuntimeError, match="rotary: cos / sin must be"):
        ops.rotary(qkv, cos[:, :2], sin)


needs_bf16_rows = pytest.mark.skipif(
    not cpu_kernels.load().linear_rows_available(), reason="linear_rows is built on CPUs with AVX-512 BF16 only"
)


@needs_bf16_rows
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 100), (16, 32), (5, 31)])
def test_bf16_linear_rows_match_the_float32_product_rounded_once(n: int, k: int) -> None:
    """Every row count 1-8, with and without a bias, weight rows not a multiple of the 16 / rows taken together
    and a K not a multiple of 32: the float32 product of the bfloat16 inputs, rounded to bfloat16 once."""
    ops = cpu_kernels.load()
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    for rows in range(1, 9):
        x = torch.randn(rows, k, generator=g).bfloat16()
        for b in (None, bias):
            want = F.linear(x.double(), w.double(), None if b is None else b.double())
            got = ops.linear_rows(x, w, b)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            assert torch.allclose(got.double(), want, rtol=2**-8, atol=1e-6), (rows, b is None)
            # as close as PyTorch's own bfloat16 linear
            torch_err = (F.linear(x, w, b).double() - want).abs().max()
            assert (got.double() - want).abs().max() <= max(torch_err, torch.tensor(1e-6, dtype=torch.float64))
            # each row's sums in the same order whatever the rows taken with it (one or two rows read the weight
            # rows one after the other, more read them side by side)
            alone = torch.cat([ops.linear_rows(x[i : i + 1].contiguous(), w, b) for i in range(rows)])
            assert torch.equal(got, alone), (rows, b is None)


@needs_bf16_rows
def test_bf16_linear_rows_refuse_what_they_cannot_compute() -> None:
    ops = cpu_kernels.load()
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="linear_rows: 1 to 8 rows"):
        ops.linear_rows(torch.zeros(9, 64, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="linear_rows: bfloat16"):
        ops.linear_rows(torch.zeros(1, 64), w.float(), None)
    with pytest.raises(RuntimeError, match=r"linear_rows: x \[M, K\] and w \[N, K\]"):
        ops.linear_rows(torch.zeros(1, 32, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="linear_rows: contiguous"):
        ops.linear_rows(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(64, 8, dtype=torch.bfloat16).t(), None)


class Counted:
    """Miles' loaded kernels, counting the row kernel's calls (four in each decode block) and the blocks."""

    def __init__(self, ops: object) -> None:
        self.ops, self.calls, self.blocks = ops, 0, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.ops, name)

    def linear_rows(self, *args: object) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.ops.linear_rows(*args)
        return out

    def decode_block(self, *args: object) -> torch.Tensor:
        self.calls += 4  # q/k/v, o, gate/up, down
        self.blocks += 1
        out: torch.Tensor = self.ops.decode_block(*args)
        return out

    def decode_blocks(self, *args: Any) -> torch.Tensor:
        layers = len(args[-1]) // 2  # (two norm epsilons a layer)
        self.calls += 4 * layers
        self.blocks += layers
        out: torch.Tensor = self.ops.decode_blocks(*args)
        return out


@needs_bf16_rows
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_bf16_engine_decodes_on_the_row_kernel_up_to_the_rows_it_measured(
    engine_models: dict[str, Path], arch: str
) -> None:
    """A bfloat16 decode step of one request runs every dense linear (q/k/v with Qwen2's biases, o, gate/up,
    down and the head) on the kernel, and its logits stay within bfloat16 rounding of oneDNN's. The first
    forward of a few rows after the weights were packed times the kernel against oneDNN on them, once; two
    requests then run on the kernel exactly when it measured it as fast at two rows; forced to, the kernel
    decodes two requests as oneDNN does."""
    from miles.engine.model_runner import ModelRunner

    cpu_kernels.rows_limit_file().unlink(missing_ok=True)  # measured by no engine here yet
    runner = ModelRunner(engine_models[arch], dtype="bfloat16")
    assert runner._rows_max == 1 and runner._rows_pending
    counted = Counted(runner._ops)
    runner._ops = counted
    linears = 4 * len(runner.layers) + 1
    runner.prefill(0, [[3, 4, 5, 6]], [0], [False])  # four rows on oneDNN, which packs its weights
    assert runner._rows_pending and len(runner._dense) == linears - 1  # the head read one row: the kernel
    runner.decode([7], [4])  # one row: the kernel; nothing measured yet
    assert runner._rows_pending
    runner.prefill(0, [[3, 4, 5, 6]], [0], [False])  # measures, once
    assert not runner._rows_pending and not runner._dense and runner._rows_max in (1, 2, 4, 8)
    assert not cpu_kernels.rows_limit_file().exists()  # a tiny model's weights sit in a cache: not kept
    counted.calls = 0
    kernel, _ = runner.decode([7], [4])
    assert counted.calls == linears
    runner._rows_max, chosen = 0, runner._rows_max
    runner.prefill(0, [[3, 4, 5, 6]], [0], [False])
    onednn, _ = runner.decode([7], [4])
    assert torch.allclose(kernel, onednn, atol=0.05, rtol=0.05) and kernel.argmax() == onednn.argmax()
    runner._rows_max = chosen

    two = ([[3, 4, 5], [8, 9, 10]], [0, 0], [False, False])
    runner.prefill(0, *two)
    counted.calls = 0
    runner.decode([7, 11], [3, 3])
    assert counted.calls == (linears if chosen >= 2 else 0)
    assert not runner._rows_pending

    runner._rows_max = 8
    runner.prefill(0, *two)
    counted.calls = 0
    kernel, _ = runner.decode([7, 11], [3, 3])
    assert counted.calls == linears
    runner._rows_max = 0
    runner.prefill(0, *two)
    onednn, _ = runner.decode([7, 11], [3, 3])
    assert torch.allclose(kernel, onednn, atol=0.05, rtol=0.05)
    assert torch.equal(kernel.argmax(-1), onednn.argmax(-1))


@needs_bf16_rows
def test_an_unreadable_kept_row_limit_is_measured_again() -> None:
    path = cpu_kernels.rows_limit_file()
    for text in ("{", '{"rows_limit": 3}', '{"other": 1}', "[]"):
        path.write_text(text)
        assert cpu_kernels.saved_rows_limit() is None, text
    cpu_kernels.save_rows_limit(4, {2: (1.0, 2.0), 4: (1.0, 1.5), 8: (2.0, 1.0)})
    assert cpu_kernels.saved_rows_limit() == 4 and not list(path.parent.glob("*.tmp"))
    assert json.loads(path.read_text())["seconds"]["8"] == {"kernel": 2.0, "onednn": 1.0}
    path.unlink()


@needs_bf16_rows
def test_an_engine_takes_the_row_limit_kept_on_this_machine(engine_models: dict[str, Path]) -> None:
    """Another engine on the machine decodes as the first measured (the kernel and oneDNN round differently):
    it reads the kept limit and measures nothing."""
    from miles.engine.model_runner import ModelRunner

    cpu_kernels.save_rows_limit(2, {2: (1.0, 2.0), 4: (2.0, 1.0), 8: (2.0, 1.0)})
    try:
        runner = ModelRunner(engine_models["qwen2"], dtype="bfloat16")
        assert runner._rows_max == 2 and not runner._rows_pending
        counted = Counted(runner._ops)
        runner._ops = counted
        runner.prefill(0, [[3, 4, 5], [8, 9, 10]], [0, 0], [False, False])
        counted.calls = 0
        runner.decode([7, 11], [3, 3])
        assert counted.calls == 4 * len(runner.layers) + 1 and not runner._dense
    finally:
        cpu_kernels.rows_limit_file().unlink(missing_ok=True)


def test_the_row_kernel_takes_the_rows_up_to_where_it_first_loses() -> None:
    """Losing means a sweep over 1 + ROWS_CREDIT times oneDNN's (the kernel's path saves the decode block's work)."""
    assert cpu_kernels.ROWS_CREDIT == 0.1
    assert cpu_kernels.rows_limit({2: (1.0, 2.0), 4: (1.0, 1.5), 8: (1.0, 1.2)}) == 8
    assert cpu_kernels.rows_limit({2: (1.0, 2.0), 4: (1.7, 1.5), 8: (1.0, 1.2)}) == 2  # counting up: stops at 4
    assert cpu_kernels.rows_limit({2: (2.3, 2.0), 4: (1.0, 1.5), 8: (1.0, 1.2)}) == 1
    assert cpu_kernels.rows_limit({4: (1.0, 1.0), 2: (1.0, 1.0)}) == 4  # a tie goes to the kernel
    assert cpu_kernels.rows_limit({2: (1.0, 1.0), 4: (1.0, 1.0), 8: (14.2, 14.1)}) == 8  # within the credit
    assert cpu_kernels.rows_limit({2: (1.0, 1.0), 4: (1.0, 1.0), 8: (14.2, 14.1)}, credit=0.0) == 4


def decode_steps(runner: Any, steps: int = 5) -> tuple[torch.Tensor, ...]:
    """Three requests of different lengths prefilled, then ``steps`` greedy decode steps of the three and one
    step of the second alone: the logits of each, and the KV caches."""
    prompts = [[3, 4, 5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25]]
    runner.prefill(0, [p[:-1] for p in prompts], [0, 0, 0], [False] * 3)
    tokens, positions, logits = [p[-1] for p in prompts], [len(p) - 1 for p in prompts], []
    for _ in range(steps):
        step, _ = runner.decode(tokens, positions)
        logits.append(step)
        tokens, positions = step.argmax(-1).tolist(), [p + 1 for p in positions]
    alone, _ = runner.decode([tokens[1]], [positions[1]], first_slot=1)
    return torch.stack(logits), alone, runner.k.clone(), runner.v.clone()


@needs_bf16_rows
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_bf16_decode_blocks_give_the_bits_of_the_layer_by_layer_step(engine_models: dict[str, Path], arch: str) -> None:
    """A bfloat16 decode step on the row kernel runs each plain layer in one kernel call (``decode_block``): the
    same logits and KV caches, bit for bit, as the step run op by op (Qwen2's q/k/v biases; Llama), at three
    requests of different lengths and at one in another slot. Layers it does not run: Qwen3's per-head norms, an
    MoE MLP; nor rows with a LoRA adapter."""
    from miles.engine.model_runner import ModelRunner

    runs = {}
    for blocks in (True, False):
        runner = ModelRunner(engine_models[arch], dtype="bfloat16")
        assert runner._blocks
        runner._blocks, runner._rows_max, runner._rows_pending = blocks, 8, False
        counted = Counted(runner._ops)
        runner._ops = counted
        runs[blocks] = decode_steps(runner)
        assert counted.blocks == (6 * len(runner.layers) if blocks else 0)
        assert counted.calls == 6 * (4 * len(runner.layers) + 1)  # every linear of every step on the row kernel
    for with_blocks, layer_by_layer in zip(runs[True], runs[False], strict=True):
        assert torch.equal(with_blocks, layer_by_layer)

    for other in ("qwen3_moe", "qwen2_moe"):
        assert not ModelRunner(engine_models[other], dtype="bfloat16")._blocks

    runner = ModelRunner(engine_models[arch], dtype="bfloat16")
    runner._rows_max, runner._rows_pending = 8, False
    layer = runner.layers[0].self_attn.q_proj.weight
    g = torch.Generator().manual_seed(0)
    runner.lora.load_tensors(
        "a",
        {
            "model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, layer.shape[1], generator=g),
            "model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(layer.shape[0], 2, generator=g),
        },
        {"r": 2, "lora_alpha": 4},
        source="test",
    )
    counted = Counted(runner._ops)
    runner._ops = counted
    runner.prefill(0, [[3, 4, 5], [8, 9, 10]], [0, 0], [False, False])
    runner.lora.set_rows(["a", None])
    runner.decode([7, 11], [3, 3])
    assert counted.blocks == 0  # the adapter's row: layer by layer
    runner.lora.set_rows([None, None])
    runner.decode([7, 11], [4, 4])
    assert counted.blocks == len(runner.layers)


def test_decode_blocks_name_what_their_weights_lack() -> None:
    """``decode_blocks`` checks its lists before any layer runs: nine weights and two epsilons a layer, and the
    weights no layer goes without (the biases may be None)."""
    ops = cpu_kernels.load()
    x = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    cache = torch.zeros(1, 1, 1, 4, 8, dtype=torch.bfloat16)
    step = (x, x, x, 1, 1, cache, cache, 0, torch.zeros(1, dtype=torch.long), 1, 1.0)
    with pytest.raises(RuntimeError, match=r"decode_blocks: 9 weights and 2 eps per layer \(8 weights, 2 eps\)"):
        ops.decode_blocks(*step, [x] * 8, [1e-6, 1e-6])
    weights: list[torch.Tensor | None] = [x] * 9
    weights[6] = None
    with pytest.raises(RuntimeError, match="decode_blocks: layer 0 lacks weight 6"):
        ops.decode_blocks(*step, weights, [1e-6, 1e-6])


@needs_bf16_rows
def test_decode_blocks_take_weights_loaded_and_released_after_their_first_step(engine_models: dict[str, Path]) -> None:
    """The decode blocks gather each layer's weights once, at the first step: weights loaded later (copied into
    those tensors) and a release and resume of the weights (their storage emptied and refilled, then loaded) decode
    what a runner started on the new weights decodes, bit for bit."""
    from miles.engine.model_runner import ModelRunner
    from miles.engine.weight_sync import MemoryOccupation

    def on_blocks(runner: ModelRunner) -> ModelRunner:
        runner._rows_max, runner._rows_pending = 8, False
        runner._ops = Counted(runner._ops)
        return runner

    fresh = decode_steps(on_blocks(ModelRunner(engine_models["qwen2_b"], dtype="bfloat16")))
    runner = on_blocks(ModelRunner(engine_models["qwen2"], dtype="bfloat16"))
    before = decode_steps(runner)
    assert runner._ops.blocks > 0 and not torch.equal(before[0], fresh[0])
    runner.load_weights(engine_models["qwen2_b"])
    for loaded, started in zip(decode_steps(runner), fresh, strict=True):
        assert torch.equal(loaded, started)

    class Paused:  # what MemoryOccupation asks of the scheduler
        paused = "retract"

        def __init__(self, runner: ModelRunner) -> None:
            self.runner = runner

        def flush_cache(self) -> None:
            pass

    occupation = MemoryOccupation()
    runner.load_weights(engine_models["qwen2"])
    assert occupation.release(Paused(runner), ["weights"])["freed_bytes"] > 0
    occupation.resume(Paused(runner), ["weights"])
    runner.load_weights(engine_models["qwen2_b"])
    for loaded, started in zip(decode_steps(runner), fresh, strict=True):
        assert torch.equal(loaded, started)
