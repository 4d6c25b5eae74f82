"""The XOR + zstd delta encoding and the zero-copy safetensors files: exact round trips and clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zstandard

from miles.transport.delta_codec import decode_delta, encode_delta, xor_
from miles.transport.files import atomic_directory, map_safetensors, write_safetensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_delta_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    old = (torch.randn(64, 48) * 0.02).to(dtype)
    new = (old.float() + 1e-4 * torch.randn(64, 48)).to(dtype)
    frame = encode_delta(new, old, zstandard.ZstdCompressor(level=3))
    assert frame is not None
    delta = decode_delta(frame, old, zstandard.ZstdDecompressor())
    target = old.clone()
    xor_(target, delta)
    assert torch.equal(target.view(torch.uint8), new.view(torch.uint8))
    xor_(target, delta)  # its own inverse: back to the old bits
    assert torch.equal(target.view(torch.uint8), old.view(torch.uint8))


def test_unchanged_tensor_has_no_frame_and_small_changes_compress() -> None:
    torch.manual_seed(1)
    old = (torch.randn(256, 256) * 0.02).to(torch.bfloat16)
    assert encode_delta(old.clone(), old, zstandard.ZstdCompressor()) is None
    # an lr-1e-5-sized update moves a minority of bfloat16 values by one or two ulps
    new = (old.float() + 1e-5 * torch.randn(256, 256).sign()).to(torch.bfloat16)
    changed = float((new != old).float().mean())
    frame = encode_delta(new, old, zstandard.ZstdCompressor(level=3))
    assert frame is not None and 0.01 < changed < 0.5
    assert len(frame) < 0.25 * old.numel() * 2


def test_corrupt_or_wrong_size_frames_are_refused() -> None:
    old = torch.zeros(32, dtype=torch.float32)
    new = torch.arange(32, dtype=torch.float32)
    frame = encode_delta(new, old, zstandard.ZstdCompressor(write_checksum=True))
    assert frame is not None
    with pytest.raises(ValueError, match="expected 64 bytes|holds more"):
        decode_delta(frame, torch.zeros(16), zstandard.ZstdDecompressor())
    broken = bytearray(frame)
    broken[len(broken) // 2] ^= 0xFF
    with pytest.raises(ValueError, match="corrupt delta frame|holds"):
        decode_delta(bytes(broken), old, zstandard.ZstdDecompressor())


def test_safetensors_written_without_copies_load_everywhere(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
    }
    size = write_safetensors(tmp_path / "x.safetensors", tensors)
    assert size == (tmp_path / "x.safetensors").stat().st_size
    loaded = load_file(str(tmp_path / "x.safetensors"))
    mapped = map_safetensors(tmp_path / "x.safetensors")
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t) and loaded[name].dtype == t.dtype
        assert torch.equal(mapped[name], t) and mapped[name].shape == t.shape
    mapped["a"].zero_()  # a private mapping: the file keeps its bytes
    assert torch.equal(map_safetensors(tmp_path / "x.safetensors")["a"], tensors["a"])
    with pytest.raises(ValueError, match="must be contiguous"):
        write_safetensors(tmp_path / "y.safetensors", {"t": torch.randn(4, 4).t()})
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 7)
    with pytest.raises(ValueError, match="bad.safetensors: not a safetensors file"):
        map_safetensors(tmp_path / "bad.safetensors")


def test_atomic_directory_never_leaves_a_half_version(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="crash"), atomic_directory(tmp_path / "v1") as folder:
        (folder / "part.bin").write_bytes(b"123")
        raise RuntimeError("crash mid-write")
    assert not (tmp_path / "v1").exists() and not (tmp_path / "v1.partial").exists()
    with atomic_directory(tmp_path / "v1") as folder:
        assert folder.name == "v1.partial"
        (folder / "part.bin").write_bytes(b"123")
    assert (tmp_path / "v1" / "part.bin").read_bytes() == b"123"
    with pytest.raises(FileExistsError), atomic_directory(tmp_path / "v1"):
        pass
