"""Which engine request sampled which response token, on the trainer side.

A multi-turn session's sample is several engine requests (:attr:`miles.types.Sample.request_spans`); the
trainer's replay of the engine (``train.true_on_policy``) recomputes each as its own request. The spans reach
the trainer in ``TrainBatch.response_tensors[REQUEST_INDEX]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles.types import Sample

if TYPE_CHECKING:
    import torch

__all__ = ["REQUEST_INDEX", "pack_request_spans", "spans_of"]

REQUEST_INDEX = "request_index"
"""Name of the ``[R]`` int64 response tensor: per response token, the index of the request of its sample that
sampled it (``-1``: no request did; a tool, user or template token between two turns)."""


def pack_request_spans(samples: Sequence[Sample]) -> torch.Tensor | None:
    """``[R]`` int64 over the responses of ``samples`` in order, or ``None`` when no sample has spans (a
    sample without spans is one request: every token ``0``)."""
    import torch

    if not any(s.request_spans for s in samples):
        return None
    parts = []
    for sample in samples:
        if not sample.request_spans:
            parts.append(torch.zeros(sample.response_length, dtype=torch.int64))
            continue
        row = torch.full((sample.response_length,), -1, dtype=torch.int64)
        for k, (start, end) in enumerate(sample.request_spans):
            row[start:end] = k
        parts.append(row)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def spans_of(row: torch.Tensor) -> list[tuple[int, int]]:
    """The request spans of one sequence's ``REQUEST_INDEX`` row: its runs of one index ``>= 0``."""
    values = row.tolist()
    spans: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            if values[start] >= 0:
                spans.append((start, i))
            start = i
    return spans
