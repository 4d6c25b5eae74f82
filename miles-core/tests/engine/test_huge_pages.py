"""The engine's weights in one block on transparent huge pages: where they lie, the same bits, loads follow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from miles.engine import huge_pages
from miles.engine.huge_pages import huge_page_bytes, huge_pages_unavailable

UNAVAILABLE = huge_pages_unavailable()

# 5 layers of 512 wide: 37 MiB of bfloat16 weights, 74 of float32 (from 32 MiB the engine uses huge pages)
SHAPE: dict[str, Any] = {"hidden_size": 512, "intermediate_size": 2048, "num_layers": 5, "num_heads": 8}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("huge-pages")
    return {
        "qwen2": build_tiny_model(root / "qwen2", "qwen2", seed=0, **SHAPE),  # q/k/v biases, an untied head
        "qwen2_b": build_tiny_model(root / "qwen2_b", "qwen2", seed=1, **SHAPE),
        "llama_tied": build_tiny_model(root / "llama", "llama", seed=0, tie_word_embeddings=True, **SHAPE),
    }


def placed(runner: Any) -> list[torch.Tensor]:
    """Every tensor the arena should hold: the projections (fused or not), their biases, embedding and head."""
    out: list[torch.Tensor] = [runner.text_model.embed_tokens.weight, runner.model.lm_head.weight]
    for layer in runner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            out += [lin.weight] + ([lin.bias] if lin.bias is not None else [])
    return out


def pin_kernels(runner: Any) -> Any:
    """The same matmul kernels for every runner of a comparison: bfloat16 rows on Miles' row kernel up to 8 where it
    is built, oneDNN otherwise (an engine that finds no kept row limit measures one at its first few-row step and
    runs that step on oneDNN: other bits than the steps after it)."""
    runner._rows_max, runner._rows_pending = (8 if runner._rows_max else 0), False
    return runner


def decode(runner: Any, steps: int = 4) -> tuple[torch.Tensor, ...]:
    """Two requests prefilled, ``steps`` greedy decode steps of both: their logits, and the KV caches."""
    prompts = [[3, 4, 5, 6, 7, 8], [11, 12, 13]]
    runner.prefill(0, [p[:-1] for p in prompts], [0, 0], [False, False])
    tokens, positions, logits = [p[-1] for p in prompts], [len(p) - 1 for p in prompts], []
    for _ in range(steps):
        step, _ = runner.decode(tokens, positions)
        logits.append(step)
        tokens, positions = step.argmax(-1).tolist(), [p + 1 for p in positions]
    return torch.stack(logits), runner.k.clone(), runner.v.clone()


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no transparent huge pages here: {UNAVAILABLE}")
@pytest.mark.parametrize(("arch", "dtype"), [("qwen2", "float32"), ("qwen2", "bfloat16"), ("llama_tied", "bfloat16")])
def test_the_weights_lie_in_one_block_on_huge_pages_and_decode_the_same_bits(
    models: dict[str, Path], arch: str, dtype: str
) -> None:
    from miles.engine.model_runner import ModelRunner

    torch.set_num_threads(1)
    runs = {}
    for on in (True, False):
        runner = ModelRunner(models[arch], dtype=dtype, huge_pages=on)
        pin_kernels(runner)
        storages = {t.untyped_storage().data_ptr() for t in placed(runner)}
        if on:
            assert len(storages) == 1, "every projection, bias, the embedding and the head in one block"
            block = placed(runner)[0]
            size = sum({t.data_ptr(): t.numel() * t.element_size() for t in placed(runner)}.values())
            assert huge_page_bytes(block) >= size // 2, (runner.huge_pages, huge_page_bytes(block), size)
            assert runner.huge_pages.endswith("MiB of weights on 2 MiB pages"), runner.huge_pages
            for i, layer in enumerate(runner.layers):  # the fused matrices are the block's, not copies of it
                fused_qkv, _ = runner._fused_qkv[i]
                assert (
                    layer.self_attn.k_proj.weight.data_ptr()
                    == fused_qkv[layer.self_attn.q_proj.weight.shape[0] :].data_ptr()
                )
        else:
            assert len(storages) > 1 and runner.huge_pages == "off (huge_pages = false)"
        runs[on] = decode(runner)
    for with_huge_pages, without in zip(runs[True], runs[False], strict=True):
        assert torch.equal(with_huge_pages, without)


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no transparent huge pages here: {UNAVAILABLE}")
def test_weights_loaded_later_land_in_the_block(models: dict[str, Path]) -> None:
    """Loading another checkpoint copies into the block: the engine then decodes as one started on it."""
    from miles.engine.model_runner import ModelRunner

    torch.set_num_threads(1)
    runner = pin_kernels(ModelRunner(models["qwen2"], dtype="bfloat16"))
    block = placed(runner)[0].untyped_storage().data_ptr()
    assert runner.load_weights(models["qwen2_b"]) > 0
    assert {t.untyped_storage().data_ptr() for t in placed(runner)} == {block}
    fresh = pin_kernels(ModelRunner(models["qwen2_b"], dtype="bfloat16"))
    for loaded, started in zip(decode(runner), decode(fresh), strict=True):
        assert torch.equal(loaded, started)


def test_where_the_kernel_has_them_off_the_engine_says_why(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from miles.engine.model_runner import ModelRunner

    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", setting)
    reason = f"the kernel's transparent huge pages are off ({setting}: always madvise [never])"
    assert huge_pages_unavailable() == reason
    runner = ModelRunner(models["qwen2"], dtype="float32")
    assert runner.huge_pages == reason
    assert len({t.untyped_storage().data_ptr() for t in placed(runner)}) > 1
    monkeypatch.setattr(huge_pages, "THP_ENABLED", tmp_path / "absent")
    assert huge_pages_unavailable() == f"{tmp_path / 'absent'} cannot be read (No such file or directory)"


def test_a_switch_on_by_default_is_turned_off_on_the_engines_command_line(tmp_path: Path) -> None:
    """``huge_pages = false`` in a run's engine table reaches the engine process as ``--no-huge-pages``."""
    from miles.engine.options import ServeOptions, parse_serve_args, to_argv

    (tmp_path / "config.json").write_text("{}")
    off = ServeOptions(model=tmp_path, huge_pages=False)
    assert "--no-huge-pages" in to_argv(off) and "--huge-pages" not in to_argv(off)
    assert parse_serve_args(to_argv(off)).huge_pages is False
    on = ServeOptions(model=tmp_path, enable_debug_endpoints=True)
    assert not any("huge-pages" in flag for flag in to_argv(on)) and "--enable-debug-endpoints" in to_argv(on)
    assert parse_serve_args(to_argv(on)).huge_pages is True
    assert parse_serve_args(["--model", str(tmp_path), "--huge-pages"]).huge_pages is True


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no transparent huge pages here: {UNAVAILABLE}")
def test_server_info_says_where_the_weights_lie(models: dict[str, Path]) -> None:
    import asyncio

    from miles.engine.launch import build_engine

    for on, said in ((True, "MiB of weights on 2 MiB pages"), (False, "off (huge_pages = false)")):
        state = build_engine(models["qwen2"], huge_pages=on)
        try:
            info = asyncio.run(state.server_info())
        finally:
            state.scheduler.stop()
        assert info["huge_pages"] is on and info["weights_on_huge_pages"].endswith(said), info


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no transparent huge pages here: {UNAVAILABLE}")
@pytest.mark.parametrize("move", ["shared_memory", "release_and_resume"])
def test_the_block_moved_whole_keeps_every_view_and_takes_the_next_weights(models: dict[str, Path], move: str) -> None:
    """``p2p``'s direct writes move the block to shared memory in place; colocated training releases it and
    resumes it zero-filled: either way every projection and fused matrix stays a view of the one block, and the
    next weights loaded give what an engine started on them decodes."""
    from miles.engine.launch import build_engine
    from miles.engine.model_runner import ModelRunner
    from miles.engine.weight_sync import MemoryOccupation

    torch.set_num_threads(1)
    state = build_engine(models["qwen2"], dtype="bfloat16", max_cache_tokens=0, start=False)
    runner = pin_kernels(state.scheduler.runner)
    try:
        block = placed(runner)[0].untyped_storage()
        if move == "shared_memory":
            block.share_memory_()  # what miles_p2p's receiver does before the trainer writes into the weights
            assert block.is_shared()
        else:
            occupation = MemoryOccupation()
            assert occupation.release(state.scheduler, ["weights"])["freed_bytes"] >= block.nbytes()
            assert block.nbytes() == 0
            occupation.resume(state.scheduler, ["weights"])
            assert float(runner._fused_mlp[0].abs().sum()) == 0.0  # zero-filled until the next push
        assert {t.untyped_storage().data_ptr() for t in placed(runner)} == {block.data_ptr()}
        runner.load_weights(models["qwen2_b"])
        state.scheduler.resume()
        fresh = pin_kernels(ModelRunner(models["qwen2_b"], dtype="bfloat16"))
        for loaded, started in zip(decode(runner), decode(fresh), strict=True):
            assert torch.equal(loaded, started)
    finally:
        state.scheduler.stop()


# glibc's mmap threshold raised to 16 MiB (it follows the largest mapped chunk freed), then three 15 MiB chunks
# written and freed beside a fourth that stays: 45 MiB of freed, written heap memory in a bin, which glibc hands
# out again for a request of that size instead of a fresh mapping (a long-lived process's case)
_FROM_THE_HEAP = """
import ctypes, sys
import torch
from miles.engine.huge_pages import WeightArena, huge_page_bytes

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
MB = 1 << 20
mapped = torch.empty(16 * MB, dtype=torch.uint8)
mapped.fill_(1)
del mapped
chunks = [libc.malloc(15 * MB) for _ in range(4)]
for chunk in chunks:
    ctypes.memset(chunk, 1, 15 * MB)
for chunk in chunks[:3]:
    libc.free(chunk)
arena = WeightArena(37 * MB)
carved = min(chunks[:3]) <= arena.bytes.data_ptr() < max(chunks[:3]) + 15 * MB
arena.bytes.fill_(2)
print(int(carved), huge_page_bytes(arena.bytes) >> 20)
"""


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no transparent huge pages here: {UNAVAILABLE}")
def test_a_block_carved_from_heap_memory_written_before_lies_on_huge_pages() -> None:
    """The allocator may hand the block memory it had before (written in 4 KiB pages, which the advice alone
    leaves as they are; seen as "0 of 37 MiB" in a long pytest process): the block's pages are dropped after
    the advice, and its first touch maps huge pages."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FROM_THE_HEAP], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    carved, on_huge_pages = (int(v) for v in out.stdout.split())
    if not carved:
        pytest.skip("this C library mapped the block afresh rather than reuse its freed heap memory")
    assert on_huge_pages >= 36, out.stdout
