"""The engine's logit masks on the trainer side: packed per response token, applied to the trainer's logits.

The engine masks EOS and ``stop_token_ids`` out of the first ``min_new_tokens`` positions of a response and
reports the logprob of the renormalised distribution (:mod:`miles.rollout.facts`). A trainer scoring the
unmasked distribution is off by ``-log(1 - p(masked))`` at each such position (0.01-0.06 nats on SmolLM2),
which biases the importance ratio of every fixed-length run. The samples' masks reach the trainer in
``TrainBatch.response_tensors[LOGIT_MASK_IDS]``; :func:`apply_logit_masks` sets the same logits to ``-inf``
before the temperature and the log-softmax, as the engine does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles.types import Sample

if TYPE_CHECKING:
    import torch

__all__ = ["LOGIT_MASK_IDS", "apply_logit_masks", "pack_logit_masks"]

LOGIT_MASK_IDS = "logit_mask_ids"
"""Name of the ``[R, M]`` int64 response tensor: per response token, the token ids masked out of its
distribution (``-1`` pads the rows with fewer)."""


def pack_logit_masks(samples: Sequence[Sample]) -> torch.Tensor | None:
    """``[R, M]`` int64 over the responses of ``samples`` in order (``-1`` where nothing is masked), or
    ``None`` when no sample has a mask."""
    import torch

    if not any(s.logit_masks for s in samples):
        return None
    rows: list[list[int]] = []
    for sample in samples:
        per_token: list[set[int]] = [set() for _ in range(sample.response_length)]
        for mask in sample.logit_masks:
            for position in range(mask.start, min(mask.end, sample.response_length)):
                per_token[position].update(mask.token_ids)
        rows.extend(sorted(ids) for ids in per_token)
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), -1, dtype=torch.int64)
    for i, ids in enumerate(rows):
        if ids:
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out


def apply_logit_masks(logits: torch.Tensor, mask_ids: torch.Tensor | None) -> torch.Tensor:
    """``logits`` (``[T, V]``) with the ids of ``mask_ids`` (``[T, M]``, ``-1`` = none) set to ``-inf`` in
    their rows (a new tensor; the masked logits get no gradient). ``None`` or an all ``-1`` mask returns
    ``logits`` itself."""
    import torch

    if mask_ids is None:
        return logits
    valid = mask_ids >= 0
    if not bool(valid.any()):
        return logits
    vocab = logits.shape[-1]
    if int(mask_ids.max()) >= vocab:
        raise ValueError(f"logit mask: token id {int(mask_ids.max())} is outside the vocabulary of {vocab}")
    # invalid slots point at an extra column, so every write of the scatter is a True
    index = torch.where(valid, mask_ids, torch.full_like(mask_ids, vocab)).to(logits.device)
    mask = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, index, True)
    return logits.masked_fill(mask[:, :vocab], float("-inf"))
