"""Sampling in-process: the reported logprob is that of softmax(logits / T) (raw: of softmax(logits)),
top-k / top-p / min-p never pick outside their set, seeds reproduce, banned tokens are never drawn."""

from __future__ import annotations

import torch

from miles.engine.sampling import sample_rows
from miles.rollout.protocol import SamplingParams


def draw(
    logits: torch.Tensor, cfg: SamplingParams, seed: int, banned: list[int] | None = None
) -> tuple[int, float, float]:
    gen = torch.Generator().manual_seed(seed)
    ids, lps, raws = sample_rows(logits[None].clone(), [cfg], [gen], [banned or []])
    return ids[0], lps[0], raws[0]


def test_logprob_conventions() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    tok, lp, raw = draw(logits, SamplingParams(temperature=0.6), seed=1)
    assert abs(lp - float(torch.log_softmax(logits / 0.6, -1)[tok])) < 1e-6
    assert abs(raw - float(torch.log_softmax(logits, -1)[tok])) < 1e-6
    tok, lp, _ = draw(logits, SamplingParams(temperature=0.0), seed=1)
    assert tok == int(logits.argmax()) and abs(lp - float(torch.log_softmax(logits, -1)[tok])) < 1e-6


def test_truncation_keeps_draws_inside_the_allowed_set() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(2)) * 2
    probs = torch.softmax(logits, -1)
    top5 = set(torch.topk(logits, 5).indices.tolist())
    order = torch.argsort(probs, descending=True)
    nucleus = set(order[: int((torch.cumsum(probs[order], 0) < 0.5).sum()) + 1].tolist())
    allowed_min_p = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    for seed in range(200):
        assert draw(logits, SamplingParams(top_k=5), seed)[0] in top5
        assert draw(logits, SamplingParams(top_p=0.5), seed)[0] in nucleus
        assert draw(logits, SamplingParams(min_p=0.2), seed)[0] in allowed_min_p
    assert draw(logits, SamplingParams(top_k=1, temperature=1.0), 0)[0] == int(logits.argmax())


def test_seeds_reproduce_and_banned_tokens_are_never_drawn() -> None:
    logits = torch.zeros(20)
    cfg = SamplingParams(temperature=1.0)
    first = [draw(logits, cfg, seed=s)[0] for s in range(30)]
    assert first == [draw(logits, cfg, seed=s)[0] for s in range(30)]
    assert len(set(first)) > 5
    banned = list(range(10))
    for s in range(100):
        tok, lp, _ = draw(logits, cfg, seed=s, banned=banned)
        assert tok >= 10 and abs(lp - float(torch.log(torch.tensor(0.1)))) < 1e-6  # renormalised over 10


def test_draws_follow_the_distribution() -> None:
    """20,000 draws of one row: each token's frequency within 4 standard errors of its probability (at
    temperature 0.7 and with top-p), and a truncated token never drawn."""
    logits = torch.tensor([[2.0, 0.5, -1.0, 1.0, 0.0, -30.0]])
    cfg = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=1)
    probs = torch.softmax(logits[0] / 0.7, -1)
    kept = probs.clone()
    order = torch.argsort(probs, descending=True)
    cumulative_before = torch.cumsum(probs[order], 0) - probs[order]
    kept[order[cumulative_before > 0.95]] = 0.0
    kept /= kept.sum()
    gen = torch.Generator().manual_seed(7)
    n = 20_000
    counts = torch.zeros(6)
    for _ in range(n):
        (token,), _, _ = sample_rows(logits.clone(), [cfg], [gen], [[]])
        counts[token] += 1
    freq = counts / n
    stderr = (kept * (1 - kept) / n).sqrt()
    assert bool(((freq - kept).abs() <= 4 * stderr + 1e-9).all()), (freq, kept)
    assert counts[kept == 0].sum() == 0


def test_a_batch_draws_each_row_as_it_would_be_drawn_alone() -> None:
    """Rows that draw from the whole distribution share one cumulative sum and one search: every row of a
    mixed batch (whole, top-p, top-k, greedy; temperatures 0.7-1.3; banned ids) gets the token, logprob and
    raw logprob it gets alone with the same seed."""
    vocab = 49152
    for trial in range(40):
        rows = [2, 3, 8, 16][trial % 4]
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(trial)) * (1 + trial % 5)
        configs = [
            SamplingParams(
                temperature=[1.0, 0.7, 1.3, 0.0][(trial + r) % 4],
                top_p=0.9 if (trial + r) % 5 == 1 else 1.0,
                top_k=50 if (trial + r) % 5 == 2 else -1,
            )
            for r in range(rows)
        ]
        banned = [[0, 1] if r % 3 == 0 else [] for r in range(rows)]
        seeds = [trial * 100 + r for r in range(rows)]
        together = sample_rows(
            logits.clone(), configs, [torch.Generator().manual_seed(s) for s in seeds], [list(b) for b in banned]
        )
        for r in range(rows):
            alone = sample_rows(
                logits[r : r + 1].clone(), [configs[r]], [torch.Generator().manual_seed(seeds[r])], [list(banned[r])]
            )
            assert (together[0][r], together[1][r], together[2][r]) == (alone[0][0], alone[1][0], alone[2][0])
