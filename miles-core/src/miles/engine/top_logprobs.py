"""SGLang's ``top_logprobs_num``: the ``k`` most likely tokens (and their logprobs) at each position.

Same distribution as the engine's token logprobs (see :mod:`miles.engine.sampling`): ``softmax(logits /
temperature)`` in fp32 after the ``min_new_tokens`` mask, before top-k / top-p / min-p truncation;
temperature 1 for greedy requests and for ``return_original_logprob``. Each position gets ``k`` pairs
``(logprob, token_id)`` sorted by logprob, highest first (``k`` is capped at the vocabulary size); the
server adds each token's text, giving SGLang's ``[[logprob, token_id, text], ...]`` per position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from miles.engine.request import Request

__all__ = ["TopLogprobs", "record_input_top_logprobs", "record_output_top_logprobs", "top_k_of"]

TopLogprobs = list[tuple[float, int]]
"""One position's top tokens: ``(logprob, token_id)``, highest logprob first."""


def top_k_of(logp: torch.Tensor, k: int) -> list[TopLogprobs]:
    """The ``k`` best ``(logprob, id)`` of each row of ``[N, V]`` logprobs, sorted highest first."""
    k = min(k, logp.shape[-1])
    values, ids = torch.topk(logp.float(), k, dim=-1, largest=True, sorted=True)
    return [list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]


def _temperature(req: Request) -> float:
    return 1.0 if req.config.greedy or req.return_original_logprob else req.config.temperature


def record_output_top_logprobs(running: list[Request], logits: torch.Tensor, banned: list[list[int]]) -> None:
    """Append this decode step's top tokens to ``output_top_logprobs`` of each request that asked.

    :param logits: ``[B, V]`` next-token logits of ``running`` (not modified).
    :param banned: per row, the token ids the sampler masks (EOS / stop before ``min_new_tokens``).
    """
    for row, req in enumerate(running):
        if req.top_logprobs_num <= 0 or not req.return_logprob:
            continue
        scores = logits[row].float().clone()
        if banned[row]:
            scores[banned[row]] = float("-inf")
        logp = torch.log_softmax(scores / _temperature(req), dim=-1)
        req.output_top_logprobs.extend(top_k_of(logp[None], req.top_logprobs_num))


def record_input_top_logprobs(req: Request, logits: torch.Tensor, offset: int) -> None:
    """Top tokens of prompt positions ``logprob_start_len..`` from prefill logits (row ``p - 1 - offset``
    predicts prompt token ``p``); position 0 has no prediction and gets ``None``, as in SGLang."""
    if req.top_logprobs_num <= 0:
        return
    start = req.logprob_start_len
    rows = [p - 1 - offset for p in range(max(start, 1), len(req.prompt_ids))]
    tops: list[TopLogprobs | None] = [None] if start == 0 else []
    if rows:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logp = torch.log_softmax(logits.index_select(0, index).float() / _temperature(req), dim=-1)
        tops.extend(top_k_of(logp, req.top_logprobs_num))
    req.input_top_logprobs = tops
