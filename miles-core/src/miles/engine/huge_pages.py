"""The engine's weights in one allocation on transparent huge pages (2 MiB pages, Linux).

A decode step at small batch reads every weight once and little else: it is bound by how fast memory is read.
Read through 4 KiB pages, a 270 MB weight set touches 66,000 pages, and a TLB miss costs a page walk (two
levels of walks in a virtual machine); on 2 MiB pages, 130. Measured on this project's AMD EPYC host (a VM):
the same sum over 276 MB read 29-47 GB/s on ordinary pages and 53-55 on huge pages, six allocations each, and
the row kernel's loop 33.5 GB/s against 52.6 (``docs/benchmarks.md``, "Weights on huge pages").

:class:`WeightArena` reserves one block, 2 MiB-aligned, asks the kernel for huge pages over it
(``madvise(MADV_HUGEPAGE)``: honoured where ``/sys/kernel/mm/transparent_hugepage/enabled`` says ``always`` or
``madvise``) before any byte of it is written, and hands out slices of it; the model runner copies the
projections and the embedding there and points the parameters at them. The block is an ordinary torch
allocation (weight loads copy into it; ``p2p``'s direct writes move it to shared memory, as any storage).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

__all__ = ["HUGE_PAGE", "SMALLEST", "WeightArena", "huge_page_bytes", "huge_pages_unavailable", "slice_bytes"]

HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64 and arm64 (4 KiB base pages)."""
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_MADV_HUGEPAGE = 14
_MADV_DONTNEED = 4
_ALIGN = 64
"""Each slice starts on a cache line."""
SMALLEST = 32 << 20
"""Weights fewer than this many bytes stay where they are (a few huge pages at most)."""


def huge_pages_unavailable() -> str | None:
    """Why weights cannot be put on transparent huge pages here, or ``None`` when they can."""
    if not sys.platform.startswith("linux"):
        return f"transparent huge pages are Linux's (this is {sys.platform})"
    try:
        mode = THP_ENABLED.read_text().strip()
    except OSError as exc:
        return f"{THP_ENABLED} cannot be read ({exc.strerror})"
    if "[never]" in mode:
        return f"the kernel's transparent huge pages are off ({THP_ENABLED}: {mode})"
    return None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class WeightArena:
    """``nbytes`` bytes on huge pages, handed out in slices (:meth:`take`) until full."""

    def __init__(self, nbytes: int) -> None:
        span = _round_up(max(nbytes, 1), HUGE_PAGE)
        # a page more than the span, so that a 2 MiB-aligned span fits wherever the allocator puts it
        self._raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)
        start = (-self._raw.data_ptr()) % HUGE_PAGE
        self.bytes = self._raw[start : start + nbytes]
        # the allocator may hand out memory it had before (a freed heap chunk, written in 4 KiB pages, which the
        # advice alone would leave as they are): the span's pages are dropped after the advice, so that each first
        # touch maps a huge page (the contents of an empty tensor are undefined anyway)
        libc = ctypes.CDLL(None, use_errno=True)
        for advice, name in ((_MADV_HUGEPAGE, "MADV_HUGEPAGE"), (_MADV_DONTNEED, "MADV_DONTNEED")):
            if libc.madvise(ctypes.c_void_p(self.bytes.data_ptr()), ctypes.c_size_t(span), advice) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"madvise({name}) over {span} bytes of weights failed")
        self.used = 0

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype`` in the arena."""
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        if self.used + nbytes > self.bytes.numel():
            raise ValueError(f"weight arena: {nbytes} bytes asked, {self.bytes.numel() - self.used} left")
        out = self.bytes[self.used : self.used + nbytes].view(dtype).view(shape)
        self.used += slice_bytes(shape, dtype)
        return out


def slice_bytes(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    """What :meth:`WeightArena.take` uses of the arena for a tensor (its bytes, up to the next cache line)."""
    return _round_up(int(torch.Size(shape).numel()) * dtype.itemsize, _ALIGN)


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes on huge pages now (``AnonHugePages``) of the memory mappings that hold ``tensor``'s storage
    (Linux; an arena is a mapping of its own)."""
    lo = tensor.untyped_storage().data_ptr()
    hi = lo + tensor.untyped_storage().nbytes()
    total = 0
    inside = False
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as fh:
        for line in fh:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start < hi and end > lo
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total
