"""The deterministic engine's logprobs, recomputed outside it: the engine's schedule for one request, replayed.

A declared public module of the local engine (see :mod:`miles.engine`): the FSDP trainer's true on-policy
replica (``train.true_on_policy``, miles-fsdp, for the models the batch-invariant ops of
:mod:`miles.engine.invariant` do not cover: MoE, bfloat16) loads the engine's model runner with
:func:`load_runner` and replays each request with :func:`request_logprobs`. Its names keep their meaning
across releases.

With ``enable_deterministic_inference`` the local engine computes each request the same way whatever else
runs: it prefills the request's tokens but the last prompt token from position 0 (in chunks of the
scheduler's ``_CHUNK``; an :class:`~miles.engine.prefix_cache.ExactPrefixCache` hit reuses the KV of exactly
that prefill), then feeds one token per decode step, each attending over exactly its own KV, and takes the
log-softmax of that step's fp32 logits (after the ``min_new_tokens`` mask, at the sampling temperature).
:func:`engine_logprobs` runs that schedule on a :class:`~miles.engine.model_runner.ModelRunner`, so its
values are the engine's bit for bit.

A multi-turn session's sample holds several requests: turn ``k`` is a request whose prompt is everything
before its span of :attr:`miles.types.Sample.request_spans` and whose response is that span.
:func:`request_logprobs` replays each span as its own request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from miles.engine.model_runner import ModelRunner

__all__ = ["engine_logprobs", "load_runner", "request_logprobs"]


def load_runner(
    model_path: str | Path, *, dtype: str, attention_backend: str = "auto", device: str = "cpu"
) -> ModelRunner:
    """The local engine's model runner over ``model_path``, as an engine with these options loads it (the
    same kernels, resolved the same way on this machine): what :func:`engine_logprobs` replays on. Its
    ``load_tensors(pairs, source=...)`` loads weights as an engine loads a weight update.

    :param dtype: the dtype the engines serve (``float32``, ``bfloat16`` ...; ``auto``: the checkpoint's).
    :param attention_backend: the engines' ``attention_backend`` option.
    """
    from miles.engine.model_runner import ModelRunner

    return ModelRunner(model_path, device=device, dtype=dtype, attention_backend=attention_backend, invariant=True)


def _chunk_size() -> int:
    from miles.engine import scheduler

    return int(scheduler._CHUNK)


def engine_logprobs(
    runner: Any, tokens: Sequence[int], prompt_length: int, temperature: float, mask_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The logprobs of ``tokens[prompt_length:]`` exactly as the deterministic engine reports them for one
    request of prompt ``tokens[:prompt_length]``.

    The scheduler's schedule for one request (:mod:`miles.engine.scheduler`): prefill ``tokens[:prompt - 1]``
    from position 0 in chunks, then one decode step per response token (fed the token before it, in slot 0
    over its own positions), and the sampler's arithmetic (:func:`miles.engine.sampling.sample_rows`): the
    fp32 logits, ``-inf`` at the masked ids (``mask_ids`` ``[R, M]``, ``-1`` = none), ``log_softmax`` of them
    (temperature 1) or of ``logits / temperature`` (a float32 tensor, as the engine divides).
    """
    import torch

    with torch.inference_mode():
        return _replay(runner, [int(t) for t in tokens], prompt_length, temperature, mask_ids)


def request_logprobs(
    runner: Any,
    tokens: Sequence[int],
    prompt_length: int,
    spans: Sequence[tuple[int, int]],
    temperature: float,
    mask_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The engine's logprob of every response token of ``tokens`` that a request sampled (``[R]`` fp32; NaN
    at the tokens between the spans, which no request sampled).

    :param spans: response positions ``[start, end)`` of each request (:attr:`miles.types.Sample.request_spans`);
        empty: one request sampled the whole response.
    :param mask_ids: ``[R, M]`` logit masks of the response positions (``-1`` = none).
    """
    import torch

    seq = [int(t) for t in tokens]
    response = len(seq) - prompt_length
    if not spans:
        return engine_logprobs(runner, seq, prompt_length, temperature, mask_ids)
    out = torch.full((response,), float("nan"), dtype=torch.float32)
    with torch.inference_mode():
        for start, end in spans:
            if not 0 <= start <= end <= response:
                raise ValueError(f"request_logprobs: span [{start}, {end}) is outside the {response} response tokens")
            if start == end:
                continue
            masks = None if mask_ids is None else mask_ids[start:end]
            out[start:end] = _replay(runner, seq[: prompt_length + end], prompt_length + start, temperature, masks)
    return out


def _replay(
    runner: Any, seq: list[int], prompt_length: int, temperature: float, mask_ids: torch.Tensor | None
) -> torch.Tensor:
    import torch

    if not 0 < prompt_length < len(seq):
        raise ValueError(f"engine_logprobs: prompt length {prompt_length} for a sequence of {len(seq)} tokens")
    need = prompt_length - 1
    chunk = _chunk_size()
    done = 0
    while done < need:
        piece = seq[done : min(need, done + chunk)]
        runner.prefill(0, [piece], [done], [False])
        done += len(piece)
    temps = torch.tensor([temperature], dtype=torch.float32)
    out = torch.empty(len(seq) - prompt_length, dtype=torch.float32)
    for r, position in enumerate(range(need, len(seq) - 1)):
        logits, _ = runner.decode([seq[position]], [position], first_slot=0)
        logits = logits.float().clone()
        if mask_ids is not None:
            banned = [int(t) for t in mask_ids[r].tolist() if t >= 0]
            if banned:
                logits[[0] * len(banned), banned] = float("-inf")
        raw = torch.log_softmax(logits, dim=-1)
        scaled = raw if bool((temps == 1.0).all()) else torch.log_softmax(logits / temps[:, None], dim=-1)
        out[r] = scaled[0, seq[position + 1]]
    return out
