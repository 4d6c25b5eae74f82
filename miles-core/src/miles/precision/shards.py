"""Low-precision rollout weights made from the slices the trainer ranks hold, as the ``p2p`` transport sends
them: no rank ever holds a whole tensor, yet every byte equals what :func:`miles.precision.formats.quantize`
makes of the whole tensor (what ``broadcast`` / ``disk`` push).

A slice is a block of rows (FSDP2's ``Shard(0)``) or a whole tensor. How each format's parts are made:

- ``fp8_row``, ``mxfp8`` and the block scales of ``nvfp4``: every scale covers part of one row, so each
  rank quantizes its rows with torchao and sends the values and scales of those rows;
- ``fp8_tensor`` and ``nvfp4``'s per-tensor scale: the tensor's maximum comes from every rank (one
  all-gather of each rank's maxima for the whole push); the scale is sent by one rank (a replica);
- ``fp8_block``: a 128-row block may straddle two ranks (SmolLM2's 576 rows on two ranks: 288 each), so
  every rank gathers the others' maxima of the blocks it touches; each rank quantizes its rows with the
  scales of their blocks and sends the scales of the blocks whose first row it holds.

One all-gather of JSON per push, which every rank makes (it is a collective), whatever it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from miles.precision.base import Slice, SliceT
from miles.precision.formats import FP8_MAX, GLOBAL_SCALE, SCALE, WeightFormat, quantize, quantizes, require_torchao

if TYPE_CHECKING:
    import torch

__all__ = ["quantize_shards"]

Gather = Callable[[Any], list[Any]]
"""Every rank's JSON value, in rank order (:func:`miles.training.comm.all_gather_json`)."""


def _ceil(n: int, b: int) -> int:
    return -(-n // b)


def _rows(shard: Slice) -> tuple[int, int]:
    """``(first row, rows)`` of a shard that holds whole rows; a ``ValueError`` naming it otherwise."""
    if len(shard.global_shape) != 2 or shard.offsets[1] != 0 or shard.tensor.shape[1] != shard.global_shape[1]:
        raise ValueError(
            f"{shard.name}: this rank holds the box at {list(shard.offsets)} of shape {list(shard.tensor.shape)} "
            f"of {list(shard.global_shape)}; low-precision formats need whole rows (FSDP2's Shard(0))"
        )
    return shard.offsets[0], shard.tensor.shape[0]


def _local_maxima(fmt: WeightFormat, shard: Slice) -> Any:
    """What this rank contributes to the scales it does not compute alone (JSON): the tensor's maximum,
    or ``[first block row, maxima per block]`` of the blocks its rows touch."""
    w = shard.tensor.detach()
    first, rows = _rows(shard)
    if rows == 0:
        return None
    if fmt.name in ("fp8_tensor", "nvfp4"):
        return float(w.abs().amax())
    if fmt.name == "fp8_block":
        import torch.nn.functional as F

        block_rows, block_cols = fmt.block
        top, above = divmod(first, block_rows)
        below = -(above + rows) % block_rows
        cols = w.shape[1]
        padded = F.pad(w.abs(), (0, -cols % block_cols, above, below))  # zeros leave every maximum as it is
        n_rows, n_cols = padded.shape[0] // block_rows, padded.shape[1] // block_cols
        maxima = padded.reshape(n_rows, block_rows, n_cols, block_cols).amax(dim=(1, 3))
        return [top, maxima.tolist()]
    return None


def _fp8_with_scales(w: torch.Tensor, scale_rows: torch.Tensor, block_cols: int) -> torch.Tensor:
    """``w`` in e4m3 with a float32 scale per row and column block (torchao's rounding: divide, clamp,
    round to e4m3)."""
    import torch

    expanded = scale_rows.repeat_interleave(block_cols, dim=1)[:, : w.shape[1]] if block_cols else scale_rows
    return (w.to(torch.float32) / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _scale_of(amax: float, dtype: torch.dtype) -> torch.Tensor:
    """torchao's FP8 scale of a block whose maximum is ``amax``: ``amax / 448`` in the weight's dtype, as float32."""
    import torch

    return (torch.tensor(amax, dtype=dtype) / FP8_MAX).to(torch.float32)


def quantize_shards(fmt: WeightFormat, shards: Sequence[SliceT], gather: Gather) -> list[SliceT]:
    """This rank's slices of what :meth:`~miles.precision.quantized.QuantizedRecipe.rollout_weights` makes of
    the whole tensors: ``<module>.weight`` (values), ``.weight_scale`` and ``.weight_scale_2``, each a
    :class:`~miles.training.trainer.WeightShard` at its offsets; tensors that stay high precision are
    returned as they are. A collective: every rank calls it once per push (``gather`` is the all-gather)."""
    import dataclasses

    import torch

    require_torchao(f"weight format {fmt.name!r}")
    quantized = [s for s in shards if quantizes(fmt, s.name, tuple(s.global_shape))]
    mine = {s.name: _local_maxima(fmt, s) for s in quantized}
    everyone: list[dict[str, Any]] = gather(mine)
    out: list[SliceT] = [s for s in shards if not quantizes(fmt, s.name, tuple(s.global_shape))]
    for shard in quantized:
        first, rows = _rows(shard)
        if rows == 0:
            continue
        w = shard.tensor.detach().contiguous()
        out_rows, cols = shard.global_shape
        parts: list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]] = []  # suffix, global, offsets
        if fmt.name in ("fp8_row", "mxfp8"):
            local = quantize(fmt, w)
            for suffix, part in local.items():
                parts.append((suffix, (out_rows, part.shape[1]), (first, 0), part))
        elif fmt.name == "nvfp4":
            from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

            amax = max(float(r[shard.name]) for r in everyone if r.get(shard.name) is not None)
            global_scale = per_tensor_amax_to_scale(torch.tensor(amax, dtype=w.dtype).float())
            nv = NVFP4Tensor.to_nvfp4(w, block_size=fmt.block[1], per_tensor_scale=global_scale)
            parts.append(("", (out_rows, nv.qdata.shape[1]), (first, 0), nv.qdata))
            scale = nv.scale.reshape(rows, -1)
            parts.append((SCALE, (out_rows, scale.shape[1]), (first, 0), scale))
            parts.append((GLOBAL_SCALE, (1,), (0,), global_scale.reshape(1)))  # a replica of every rank's
        elif fmt.name == "fp8_tensor":
            amax = max(float(r[shard.name]) for r in everyone if r.get(shard.name) is not None)
            scale = _scale_of(amax, w.dtype).reshape(1, 1)
            parts.append(("", (out_rows, cols), (first, 0), _fp8_with_scales(w, scale, 0)))
            parts.append((SCALE, (1, 1), (0, 0), scale))
        else:  # fp8_block: the maxima of each block over every rank holding some of its rows
            block_rows, block_cols = fmt.block
            blocks = torch.zeros(_ceil(out_rows, block_rows), _ceil(cols, block_cols), dtype=w.dtype)
            for r in everyone:
                if r.get(shard.name) is None:
                    continue
                top, maxima = r[shard.name]
                part = torch.tensor(maxima, dtype=w.dtype)
                blocks[top : top + part.shape[0]] = torch.maximum(blocks[top : top + part.shape[0]], part)
            scales = (blocks / FP8_MAX).to(torch.float32)
            row_blocks = torch.arange(first, first + rows) // block_rows
            parts.append(("", (out_rows, cols), (first, 0), _fp8_with_scales(w, scales[row_blocks], block_cols)))
            owned = range(_ceil(first, block_rows), _ceil(first + rows, block_rows))  # blocks starting here
            if len(owned):
                parts.append((SCALE, tuple(scales.shape), (owned.start, 0), scales[owned.start : owned.stop]))
        for suffix, global_shape, offsets, tensor in parts:
            out.append(
                dataclasses.replace(  # type: ignore[type-var]  # a WeightShard: a dataclass
                    shard, name=shard.name + suffix, global_shape=global_shape, offsets=offsets, tensor=tensor
                )
            )
    return out
