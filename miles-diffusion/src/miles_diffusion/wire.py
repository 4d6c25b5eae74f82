"""Tensors on the wire and in samples: ``torch.Tensor`` <-> :class:`miles.types.TensorData` (raw bytes,
dtype, shape; base64 in JSON). Exact for every dtype, never a pickle."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.types import TensorData

if TYPE_CHECKING:
    import torch

__all__ = ["tensor_data", "tensor_of"]


def tensor_data(tensor: torch.Tensor) -> TensorData:
    """The tensor's bytes (moved to the CPU, C order) with its dtype and shape."""
    import torch

    t = tensor.detach().cpu().contiguous()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return TensorData(str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)


def tensor_of(data: TensorData) -> torch.Tensor:
    """A (writable) tensor from :func:`tensor_data`'s record."""
    import torch

    dtype = getattr(torch, data.dtype)
    if not data.data:
        return torch.zeros(data.shape, dtype=dtype)
    return torch.frombuffer(bytearray(data.data), dtype=dtype).reshape(data.shape)
