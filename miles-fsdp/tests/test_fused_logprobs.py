"""The chunked fused head + log-softmax + gather equals the full-logits path (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from miles.training.logprobs import token_logprobs
from miles_fsdp.fused_logprobs import fused_token_logprobs


def _inputs(seed: int, tokens: int = 37, hidden: int = 16, vocab: int = 101) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).float()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.5).float()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    g_lp = torch.randn(tokens, generator=gen)
    g_ent = torch.randn(tokens, generator=gen)
    return h, w, targets, g_lp, g_ent


def _run(
    fused: bool, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, **kw: object
) -> tuple[torch.Tensor, ...]:
    h = h.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    g_lp, g_ent, entropy_grad = kw.pop("g_lp"), kw.pop("g_ent"), bool(kw.get("entropy_grad", False))
    temperature = float(kw.pop("temperature"))  # type: ignore[arg-type]
    if fused:
        lp, ent = fused_token_logprobs(h, w, targets, temperature, True, chunk_tokens=8, **kw)  # type: ignore[arg-type]
    else:
        lp, ent = token_logprobs(h @ w.t(), targets, temperature, True, **kw)  # type: ignore[arg-type]
    assert ent is not None
    loss = (lp * g_lp).sum()  # type: ignore[operator]
    if entropy_grad:
        loss = loss + (ent * g_ent).sum()  # type: ignore[operator]
    loss.backward()
    assert h.grad is not None and w.grad is not None
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize(
    ("temperature", "entropy_grad", "masked"),
    [(1.0, False, False), (0.7, True, False), (0.0, True, True), (1.3, False, True)],
)
def test_fused_equals_full_logits(temperature: float, entropy_grad: bool, masked: bool) -> None:
    h, w, targets, g_lp, g_ent = _inputs(0)
    mask_ids = None
    if masked:  # position 3 masks ids 5 and 9; the others none
        mask_ids = torch.full((h.shape[0], 2), -1, dtype=torch.long)
        mask_ids[3] = torch.tensor([5, 9])
        targets[3] = 7
    kw = dict(temperature=temperature, entropy_grad=entropy_grad, mask_ids=mask_ids, g_lp=g_lp, g_ent=g_ent)
    full = _run(False, h, w, targets, **dict(kw))
    fused = _run(True, h, w, targets, **dict(kw))
    for name, a, b in zip(("logprobs", "entropy", "grad hidden", "grad weight"), full, fused, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-6, msg=f"{name} differs")
    assert float(full[0].abs().min()) > 0  # the values are real logprobs, not zeros


def test_fused_tied_embedding_gradient_accumulates_both_uses() -> None:
    """A tied head (the embedding matrix) gets the embedding's gradient plus the head's."""
    torch.manual_seed(1)
    embed = torch.nn.Embedding(50, 8)
    ids = torch.randint(0, 50, (12,))
    targets = torch.randint(0, 50, (12,))
    grads = []
    for fused in (False, True):
        embed.zero_grad()
        hidden = torch.tanh(embed(ids))
        if fused:
            lp, _ = fused_token_logprobs(hidden, embed.weight, targets, 1.0, False, chunk_tokens=5)
        else:
            lp, _ = token_logprobs(hidden @ embed.weight.t(), targets, 1.0, False)
        lp.sum().backward()
        assert embed.weight.grad is not None
        grads.append(embed.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    assert float(grads[0].abs().sum()) > 0


def test_fused_bfloat16_matches_full_path_in_bfloat16() -> None:
    h, w, targets, g_lp, _ = _inputs(2)
    out = []
    for fused in (False, True):
        hb = h.bfloat16().requires_grad_(True)
        wb = w.bfloat16().requires_grad_(True)
        if fused:
            lp, _ = fused_token_logprobs(hb, wb, targets, 1.0, False, chunk_tokens=16)
        else:
            lp, _ = token_logprobs(hb @ wb.t(), targets, 1.0, False)
        (lp * g_lp).sum().backward()
        assert hb.grad is not None and wb.grad is not None and hb.grad.dtype == torch.bfloat16
        out.append((lp.detach(), hb.grad.float(), wb.grad.float()))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=0)  # same bf16 GEMM rows, same fp32 math
    torch.testing.assert_close(out[1][1], out[0][1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[1][2], out[0][2], rtol=2e-2, atol=2e-2)


def test_fused_refuses_bad_input() -> None:
    h, w, targets, _, _ = _inputs(3)
    with pytest.raises(ValueError, match="do not match"):
        fused_token_logprobs(h[:, :4], w, targets, 1.0, False)
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused_token_logprobs(h, w, targets, 1.0, False, chunk_tokens=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fused_token_logprobs(h, w, targets, 1.0, False, mask_ids=torch.full((h.shape[0], 1), 500))
