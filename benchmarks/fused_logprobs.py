"""Token logprobs from the last hidden states: the full-logits path against the chunked fused one, in one run.

For SmolLM2-135M's head (hidden 576, vocabulary 49,152, tied to the embedding) and ``T`` response tokens,
each side computes the logprob of every target and the entropy (a detached metric, as the GRPO loss uses it)
and back-propagates a random per-token gradient into the hidden states and the head's weight:

- ``full``: ``hidden @ W.T`` -> ``[T, V]`` logits -> :func:`miles.training.logprobs.token_logprobs`;
- ``fused``: :func:`miles_fsdp.fused_logprobs.fused_token_logprobs` (``--chunk`` tokens at a time).

Memory is what autograd keeps for backward (bytes of the tensors saved between forward and backward,
counted with ``saved_tensors_hooks``) plus the peak of one chunk (or the full logits) the forward creates;
time is the median wall time of forward + backward. Sides alternate within each repeat::

    python -m benchmarks.fused_logprobs                    # T = 256, 1024, 4096
    python -m benchmarks.fused_logprobs --tokens 512 --threads 2
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import add_common_args, machine_info, markdown_table, median, pin_threads, versions, write_result

log = logging.getLogger("benchmarks.fused_logprobs")

HIDDEN, VOCAB = 576, 49152
"""SmolLM2-135M's head."""


def _saved_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the bytes of the distinct tensors autograd saved for its backward."""
    import torch

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _measure(side: str, tokens: int, chunk: int, repeats: int) -> dict[str, float]:
    import torch

    from miles.training.logprobs import token_logprobs
    from miles_fsdp.fused_logprobs import fused_token_logprobs

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).requires_grad_(True)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (tokens,), generator=gen)
    grad = torch.randn(tokens, generator=gen)

    def forward() -> torch.Tensor:
        if side == "full":
            lp, _ = token_logprobs(hidden @ weight.t(), targets, 1.0, True)
        else:
            lp, _ = fused_token_logprobs(hidden, weight, targets, 1.0, True, chunk_tokens=chunk)
        return lp

    times, saved = [], 0
    for i in range(repeats + 1):
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        lp, saved = _saved_bytes(forward)
        (lp * grad).sum().backward()
        if i > 0:
            times.append(time.perf_counter() - start)
    transient = (tokens if side == "full" else min(tokens, chunk)) * VOCAB * 4
    return {"s": median(times), "saved_mib": saved / 2**20, "logits_peak_mib": transient / 2**20}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--tokens", default="256,1024,4096", help="comma-separated response-token counts")
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the fused path")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pin_threads(args.threads)
    token_counts = [256] if args.quick else [int(t) for t in args.tokens.split(",")]
    rows, records = [], []
    for tokens in token_counts:
        full: list[dict[str, float]] = []
        fused: list[dict[str, float]] = []
        for _ in range(args.repeats):  # alternate the sides
            full.append(_measure("full", tokens, args.chunk, 1))
            fused.append(_measure("fused", tokens, args.chunk, 1))
        f = {k: median([m[k] for m in full]) for k in full[0]}
        g = {k: median([m[k] for m in fused]) for k in fused[0]}
        records.append({"tokens": tokens, "full": f, "fused": g})
        rows.append(
            [
                tokens,
                f"{f['s'] * 1e3:.0f}",
                f"{g['s'] * 1e3:.0f}",
                f"{f['s'] / g['s']:.2f}x",
                f"{f['saved_mib'] + f['logits_peak_mib']:.0f}",
                f"{g['saved_mib'] + g['logits_peak_mib']:.0f}",
                f"{(f['saved_mib'] + f['logits_peak_mib']) / (g['saved_mib'] + g['logits_peak_mib']):.1f}x",
            ]
        )
    headers = ["tokens", "full ms", "fused ms", "speed (full/fused)", "full MiB", "fused MiB", "memory ratio"]
    log.info("%s", markdown_table(headers, rows))
    write_result(
        "fused_logprobs",
        {"machine": machine_info(), "versions": versions(["torch"]), "chunk": args.chunk, "results": records},
        args.results_dir,
    )


if __name__ == "__main__":
    main()
