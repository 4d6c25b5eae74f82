"""The engine's logit masks on the trainer side: packed per response token, applied to the trainer's logits.

The engine masks EOS and ``stop_token_ids`` out of the first ``min_new_tokens`` positions of a response and
reports the logprob of the renormalised distribution (:mod:`miles.rollout.facts`). A trainer scoring the
unmasked distribution is off by ``-log(1 - p(masked))`` at each such position (0.01-0.06 nats on SmolLM2),
which biases the importance ratio of every fixed-length run. The samples' masks reach the trainer in
``TrainBatch.response_tensors[LOGIT_MASK_IDS]``; :func:`apply_logit_masks` sets the same logits to ``-inf``
before the temperature and the log-softmax, as the engine does.

**Sampling-mask replay.** With top-k / top-p / min-p the engine draws each token from a truncated set,
renormalised; with ``rollout.replay_sampling_mask`` each sample carries that kept set per token
(``Sample.sampling_mask``, from the engine's ``output_token_sampling_mask``) and its rollout logprobs are
the behaviour logprobs (under the renormalised set). The kept set travels in the same per-token rows, the
complement of a mask: a kept id ``t`` is stored as ``-2 - t`` (:func:`encode_kept`), and a row holding any
such entry masks every id outside them. So every consumer of the rows (the loss, the ratio, the KL, the
mismatch metrics, the fused head) scores the renormalised distribution the engine sampled from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles.types import Sample

if TYPE_CHECKING:
    import torch

__all__ = ["LOGIT_MASK_IDS", "apply_logit_masks", "encode_kept", "has_masks", "pack_logit_masks"]

LOGIT_MASK_IDS = "logit_mask_ids"
"""Name of the ``[R, M]`` int64 response tensor: per response token, the token ids masked out of its
distribution (``-1`` pads the rows with fewer), or ``-2 - t`` for each id ``t`` of the kept set of truncated
sampling (every other id is masked)."""


def encode_kept(token_ids: Sequence[int]) -> list[int]:
    """A kept set's entries of a mask row (``-2 - t`` per kept id ``t``)."""
    return [-2 - int(t) for t in token_ids]


def has_masks(mask_ids: torch.Tensor | None) -> bool:
    """Whether ``mask_ids`` masks anything (an entry other than the ``-1`` padding)."""
    return mask_ids is not None and bool((mask_ids != -1).any())


def pack_logit_masks(samples: Sequence[Sample]) -> torch.Tensor | None:
    """``[R, M]`` int64 over the responses of ``samples`` in order (``-1`` where nothing is masked; masked ids,
    then the encoded kept set), or ``None`` when no sample has a mask or a kept set."""
    import torch

    if not any(s.logit_masks or s.sampling_mask for s in samples):
        return None
    rows: list[list[int]] = []
    for sample in samples:
        per_token: list[set[int]] = [set() for _ in range(sample.response_length)]
        for mask in sample.logit_masks:
            for position in range(mask.start, min(mask.end, sample.response_length)):
                per_token[position].update(mask.token_ids)
        for position, kept in enumerate((sample.sampling_mask or [])[: sample.response_length]):
            per_token[position].update(encode_kept(kept))
        rows.extend(
            sorted(i for i in ids if i >= 0) + sorted((i for i in ids if i < 0), reverse=True) for ids in per_token
        )
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), -1, dtype=torch.int64)
    for i, ids in enumerate(rows):
        if ids:
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out


def apply_logit_masks(logits: torch.Tensor, mask_ids: torch.Tensor | None) -> torch.Tensor:
    """``logits`` (``[T, V]``) with the ids of ``mask_ids`` (``[T, M]``, ``-1`` = none) set to ``-inf`` in
    their rows, and in a row with a kept set (entries ``-2 - t``) every id outside it (a new tensor; the masked
    logits get no gradient). ``None`` or an all ``-1`` mask returns ``logits`` itself."""
    import torch

    if mask_ids is None or not has_masks(mask_ids):
        return logits
    vocab = logits.shape[-1]
    masked, kept = mask_ids >= 0, mask_ids <= -2
    ids = torch.where(kept, -2 - mask_ids, mask_ids)
    if int(ids.max()) >= vocab:
        raise ValueError(f"logit mask: token id {int(ids.max())} is outside the vocabulary of {vocab}")
    # invalid slots point at an extra column, so every write of a scatter is a True
    extra = torch.full_like(mask_ids, vocab)
    mask = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, torch.where(masked, ids, extra).to(logits.device), True)
    mask = mask[:, :vocab]
    if bool(kept.any()):
        keep = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, torch.where(kept, ids, extra).to(logits.device), True)
        mask = mask | (kept.any(-1, keepdim=True).to(logits.device) & ~keep[:, :vocab])
    return logits.masked_fill(mask, float("-inf"))
