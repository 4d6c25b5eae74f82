"""Token sampling with exact fp32 logprobs, one seeded generator per request.

Convention (SGLang's default): the logprob reported for a sampled token is its log-probability under
``softmax(logits / temperature)`` in fp32, after the ``min_new_tokens`` mask and before top-k / top-p /
min-p truncation; that is the distribution a trainer recomputes from its own logits and the temperature.
Greedy decoding (``temperature == 0``) reports ``log_softmax(logits)``. The *raw* logprob
(``log_softmax(logits)`` without temperature, SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB``) is offered too.

With ``return_sampling_mask`` (SGLang 0.5.23's field) a row also reports the set it drew from: the token ids
that top-k / top-p / min-p kept (every id of non-zero probability when none truncates; the sampled id alone
for greedy decoding), most likely first, and the sampled token's logprob under that set renormalised (the
behaviour logprob; 0 for greedy), or in ``support`` mode the renormalised logprob of every kept id.

Sampling draws one uniform per token from a per-request ``torch.Generator`` seeded by ``sampling_seed``, row by
row (inverse transform over the cumulative probabilities), so a seeded request gets the same tokens whatever
else is in the batch (given the same logits).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from miles.rollout.protocol import SamplingParams

__all__ = ["KeptSet", "kept_set", "sample_rows"]


class KeptSet(NamedTuple):
    """The distribution one token was drawn from (SGLang's ``output_token_sampling_mask`` entry)."""

    token_ids: list[int]
    """The kept token ids, most likely first."""
    selected_logprob: float
    """The sampled token's logprob under the kept set, renormalised."""
    support_logprobs: list[float]
    """The renormalised logprob of each kept id (``support`` mode; empty otherwise)."""


def kept_set(truncated: torch.Tensor, token: int, *, support: bool = False) -> KeptSet:
    """The :class:`KeptSet` of one row from its truncated (not renormalised) probabilities ``[vocab]``."""
    positive = torch.nonzero(truncated > 0).flatten()
    weights = truncated[positive].double()
    order = torch.sort(weights, descending=True, stable=True).indices
    ids, weights = positive[order], weights[order]
    mass = weights.sum()
    selected = float(torch.log(truncated[token].double() / mass))
    logprobs = torch.log(weights / mass).tolist() if support else []
    return KeptSet([int(t) for t in ids.tolist()], selected, logprobs)


def _truncate(probs: torch.Tensor, cfg: SamplingParams) -> torch.Tensor:
    """Zero the probabilities outside top-k / top-p / min-p (not renormalised; multinomial needs not)."""
    if cfg.top_k > 0 and cfg.top_k < probs.numel():
        kth = torch.topk(probs, cfg.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=0)
        drop_sorted = (cumulative - sorted_probs) > cfg.top_p * cumulative[-1]
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if cfg.min_p > 0.0:
        probs = probs.masked_fill(probs < cfg.min_p * probs.max(), 0.0)
    return probs


def _truncates(cfg: SamplingParams) -> bool:
    """Whether :func:`_truncate` zeroes anything for ``cfg`` (top-k below the vocabulary, top-p, min-p)."""
    return cfg.top_k > 0 or cfg.top_p < 1.0 or cfg.min_p > 0.0


def _draw_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """One token per row of the (unnormalised) ``probs`` ``[R, vocab]`` by inverse transform: the first id whose
    cumulative probability exceeds ``u x total`` for one uniform ``u`` from the row's generator. Exact sampling of
    the categorical distribution (a zero-probability id is never drawn), 18x faster on a 49k vocabulary than
    ``torch.multinomial``, which draws an exponential variate per vocabulary entry (0.85 ms a row on a CPU). One
    cumulative sum and one search for all rows; each row's scan and search are its own (the same token as drawn
    alone)."""
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64, device=probs.device) for g in generators])
    target = (u * cdf[:, -1].double()).to(cdf.dtype)[:, None]
    index = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
    return [int(i) for i in index.tolist()]


def sample_rows(
    logits: torch.Tensor,
    configs: list[SamplingParams],
    generators: list[torch.Generator],
    banned: list[list[int]],
    *,
    kept: list[KeptSet | None] | None = None,
    masks: list[str | None] | None = None,
) -> tuple[list[int], list[float], list[float]]:
    """Sample one token per row of fp32 ``logits`` ``[B, vocab]``.

    :param banned: per row, token ids masked out (EOS / stop tokens before ``min_new_tokens``).
    :param masks: per row, ``None`` or the sampling-mask mode asked for (``selected`` or ``support``); each
        row's :class:`KeptSet` (or ``None``) is appended to ``kept``.
    :returns: token ids, their logprobs under the sampled distribution, and their raw logprobs.
    """
    logits = logits.float()
    rows = [row for row, ids in enumerate(banned) for _ in ids]
    if rows:  # one indexed write for the whole batch
        logits[rows, [token for ids in banned for token in ids]] = float("-inf")
    temps = torch.tensor(
        [1.0 if cfg.greedy else cfg.temperature for cfg in configs], dtype=torch.float32, device=logits.device
    )
    raw = torch.log_softmax(logits, dim=-1)
    scaled = raw if bool((temps == 1.0).all()) else torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens: list[int] = []
    greedy_rows = [i for i, cfg in enumerate(configs) if cfg.greedy]
    argmax = scaled.argmax(dim=-1).tolist() if greedy_rows else []
    # rows that draw from the whole distribution: one exp, one cumulative sum and one search for all of them
    whole = [row for row, cfg in enumerate(configs) if not cfg.greedy and not _truncates(cfg)]
    whole_probs = scaled[whole].exp() if whole else None
    drawn: dict[int, tuple[int, int]] = {}  # row: (its row of whole_probs, its token)
    if whole_probs is not None:
        tokens_drawn = _draw_rows(whole_probs, [generators[r] for r in whole])
        drawn = {row: (i, token) for i, (row, token) in enumerate(zip(whole, tokens_drawn, strict=True))}
    for row, cfg in enumerate(configs):
        mode = masks[row] if masks is not None else None
        if cfg.greedy:
            tokens.append(int(argmax[row]))
            if kept is not None:
                kept.append(None if mode is None else KeptSet([tokens[-1]], 0.0, [0.0] if mode == "support" else []))
            continue
        if row in drawn:
            assert whole_probs is not None
            truncated = whole_probs[drawn[row][0]]
            tokens.append(drawn[row][1])
        else:
            truncated = _truncate(scaled[row].exp(), cfg)
            tokens.append(_draw_rows(truncated[None], [generators[row]])[0])
        if kept is not None:
            kept.append(None if mode is None else kept_set(truncated, tokens[-1], support=mode == "support"))
    index = torch.tensor(tokens, device=logits.device)[:, None]
    logprobs = scaled.gather(1, index)[:, 0].tolist()
    raw_logprobs = raw.gather(1, index)[:, 0].tolist()
    return tokens, logprobs, raw_logprobs
