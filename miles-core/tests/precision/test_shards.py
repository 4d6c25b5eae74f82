"""Quantized rollout weights made from row slices (what ``p2p`` sends): the parts every rank makes, put
together at their offsets, are bit for bit what :func:`quantize` makes of the whole tensor, for every format,
for 1-3 ranks, with FP8 blocks straddling ranks (rows that are no multiple of 128 per rank), ragged last
blocks and ranks that hold no row."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

pytest.importorskip("torchao", reason="torchao (miles-core[quant]) is not installed")

from miles.precision.formats import FORMATS, get_format, quantize
from miles.precision.quantized import FP8, NVFP4
from miles.precision.shards import quantize_shards
from miles.training.trainer import WeightShard

SHAPES = {
    "model.layers.0.self_attn.q_proj.weight": (576, 576),  # SmolLM2: 4.5 blocks of 128
    "model.layers.0.self_attn.k_proj.weight": (192, 576),
    "model.layers.0.mlp.down_proj.weight": (64, 256),
    "model.layers.0.input_layernorm.weight": (576,),  # stays high precision
    "model.embed_tokens.weight": (320, 64),  # stays high precision
}


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(s, generator=g) * (1 + i) for i, (n, s) in enumerate(SHAPES.items())}


def _row_shards(weights: dict[str, torch.Tensor], rank: int, world: int) -> list[WeightShard]:
    """FSDP2's ``Shard(0)`` split: ``ceil(rows / world)`` rows per rank, the last ones possibly empty."""
    shards = []
    for name, w in weights.items():
        per = -(-w.shape[0] // world)
        lo, hi = min(rank * per, w.shape[0]), min((rank + 1) * per, w.shape[0])
        offsets = (lo,) + (0,) * (w.dim() - 1)
        shards.append(WeightShard(name, tuple(w.shape), offsets, w[lo:hi]))
    return shards


def _run_ranks(world: int, fn: Any) -> list[Any]:
    """``fn(rank, gather)`` on ``world`` threads; ``gather`` is a real all-gather among them."""
    barrier = threading.Barrier(world)
    box: list[Any] = [None] * world

    def gather_for(rank: int) -> Any:
        def gather(value: Any) -> list[Any]:
            box[rank] = value
            barrier.wait()
            out = list(box)
            barrier.wait()
            return out

        return gather

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(lambda r: fn(r, gather_for(r)), range(world)))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", list(FORMATS))
def test_slices_put_together_equal_the_whole_tensors_quantized(name: str, world: int) -> None:
    fmt = get_format(name)
    weights = {n: w.to(torch.bfloat16) for n, w in _weights().items()}
    per_rank = _run_ranks(world, lambda r, gather: quantize_shards(fmt, _row_shards(weights, r, world), gather))
    expected: dict[str, torch.Tensor] = {}
    for n, w in weights.items():
        if n.endswith("norm.weight") or "embed" in n or not fmt.fits(tuple(w.shape)):
            expected[n] = w
            continue
        expected.update({n + suffix: part for suffix, part in quantize(fmt, w).items()})
    assembled: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for shards in per_rank:
        for s in shards:
            full = assembled.setdefault(s.name, torch.zeros(s.global_shape, dtype=s.tensor.dtype))
            seen = covered.setdefault(s.name, torch.zeros(s.global_shape, dtype=torch.bool))
            box = tuple(slice(o, o + k) for o, k in zip(s.offsets, s.tensor.shape, strict=True))
            if seen[box].any():  # only replicas may overlap, and they must agree
                bits = full[box].reshape(-1).view(torch.uint8)
                assert torch.equal(bits, s.tensor.reshape(-1).view(torch.uint8)), f"{s.name}: replicas differ"
            full[box] = s.tensor
            seen[box] = True
    assert set(assembled) == set(expected)
    for n, want in expected.items():
        assert bool(covered[n].all()), f"{n}: not every element was sent"
        got = assembled[n]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), n
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), n


def test_fp8_blocks_straddling_ranks_take_every_ranks_maximum() -> None:
    """A 128-row block split between two ranks, its maximum on the second: both ranks' values use it."""
    fmt = get_format("fp8_block")
    w = torch.ones(128, 128)
    w[100, 5] = 400.0  # rank 1's rows (64-127) hold the block's maximum
    shards = _run_ranks(2, lambda r, gather: quantize_shards(fmt, _row_shards({"a.q_proj.weight": w}, r, 2), gather))
    scales = [s for rank in shards for s in rank if s.name == "a.q_proj.weight_scale"]
    assert len(scales) == 1 and scales[0].offsets == (0, 0)  # sent by the rank holding the block's first row
    assert float(scales[0].tensor) == pytest.approx(400.0 / 448.0)
    rank0 = next(s for s in shards[0] if s.name == "a.q_proj.weight")
    assert float(rank0.tensor.float()[0, 0]) == pytest.approx(448.0 / 400.0, rel=0.07)  # scaled by the shared max


def test_slices_that_are_not_whole_rows_are_refused_by_name() -> None:
    w = torch.randn(128, 256)
    shard = WeightShard("m.o_proj.weight", (128, 256), (0, 128), w[:, 128:])
    with pytest.raises(ValueError, match=r"m.o_proj.weight: this rank holds the box at \[0, 128\].*whole rows"):
        quantize_shards(get_format("mxfp8"), [shard], lambda v: [v])


def test_the_recipes_convert_slices_and_the_identity_recipes_pass_them() -> None:
    from miles.precision.base import PrecisionRecipe
    from miles.precision.builtin import BF16

    assert FP8.converts_shards() and NVFP4.converts_shards() and BF16.converts_shards()
    shards = _row_shards(_weights(), 0, 1)
    assert BF16(BF16.Settings()).rollout_shards(shards, lambda v: [v]) == shards

    class Whole(PrecisionRecipe):  # a third-party recipe converting whole tensors only
        name = "whole"

        def rollout_weights(self, named: Any) -> Any:
            yield from named

    assert not Whole.converts_shards()
    with pytest.raises(NotImplementedError, match="'whole' converts whole tensors only"):
        Whole(Whole.Settings()).rollout_shards(shards, lambda v: [v])
