"""The encoding of a weight delta: XOR of the new and the old bits, byte planes split, zstd-compressed.

Between two RL steps most low-precision weights keep their exact bits (an update of 1e-5 rarely moves a
bfloat16 value to its neighbour), so the XOR of the two versions is mostly zero bytes. The bytes of each
element are split into planes first (all first bytes, then all second bytes, ...): the high bytes of a
changed weight almost never change, so each plane compresses well on its own. XOR is its own inverse:
applying a delta twice restores the old tensor, which is how an engine rolls back a delta that fails its
checksum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import zstandard

__all__ = ["bits", "decode_delta", "encode_delta", "xor_"]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bits as a signed-integer view of the same element size (no copy)."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    size = tensor.element_size()
    if size not in ints:
        raise ValueError(f"no integer view for {tensor.dtype} ({size}-byte elements)")
    return tensor.view(ints[size]) if tensor.dtype != ints[size] else tensor


def _planes(delta: torch.Tensor) -> Any:
    """Bytes of ``delta`` (an integer tensor), plane by plane: a ``(element_size, numel)`` uint8 array
    (numpy's transposing copy is several times faster than torch's for this shape)."""
    import numpy as np
    import torch

    size = delta.element_size()
    flat = delta.reshape(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(flat.reshape(-1, size).T) if size > 1 else flat.reshape(1, -1)


def encode_delta(new: torch.Tensor, old: torch.Tensor, compressor: zstandard.ZstdCompressor) -> bytes | None:
    """The compressed XOR of ``new`` and ``old`` (same shape and dtype), or ``None`` when equal bit for bit."""
    import torch

    if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(f"delta between {tuple(new.shape)} {new.dtype} and {tuple(old.shape)} {old.dtype}")
    a, b = bits(new.contiguous()), bits(old.contiguous())
    if torch.equal(a, b):
        return None
    planes = _planes(torch.bitwise_xor(a, b))
    return compressor.compress(memoryview(planes))


def decode_delta(
    frame: bytes | memoryview, like: torch.Tensor, decompressor: zstandard.ZstdDecompressor
) -> torch.Tensor:
    """The XOR tensor a frame of :func:`encode_delta` holds, as integer bits shaped like ``like``.

    Raises ``ValueError`` when the frame is corrupt or does not decode to ``like``'s size.
    """
    import torch
    import zstandard

    size = like.element_size()
    numel = like.numel()
    planes = torch.empty((size, numel), dtype=torch.uint8)
    view = memoryview(planes.numpy()).cast("B")
    try:
        with decompressor.stream_reader(frame) as reader:
            filled = 0
            while filled < len(view):
                got = reader.readinto(view[filled:])
                if not got:
                    break
                filled += got
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise ValueError(f"corrupt delta frame: {exc}") from None
    if filled != len(view) or extra:
        raise ValueError(f"delta frame holds {'more' if extra else filled} bytes, expected {len(view)}")
    if size > 1:
        import numpy as np

        flat = torch.from_numpy(np.ascontiguousarray(planes.numpy().T)).view(-1)
    else:
        flat = planes.view(-1)
    return bits(flat.view(like.dtype)).view(like.shape)


def xor_(target: torch.Tensor, delta: torch.Tensor) -> None:
    """``target ^= delta`` on the bits, in place (``target`` keeps its dtype and storage)."""
    bits(target).bitwise_xor_(delta)
