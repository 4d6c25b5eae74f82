"""Token logprobs (and entropy) straight from the last hidden states, without the full ``[T, V]`` logits.

:func:`fused_token_logprobs` is the chunked fusion of the LM head's linear, the engine's logit masks, the
temperature, ``log_softmax`` and the gather of the target's logprob (the design of Liger's fused linear
cross-entropy, with a per-token result): per chunk of ``chunk_tokens`` tokens it computes the chunk's logits,
their ``logsumexp``, the target's logprob and the entropy, and keeps only those ``[T]`` vectors. Backward
recomputes each chunk's logits and forms the gradients of the hidden states and of the head's weight (tied
embeddings included: the weight is whatever tensor the head multiplies by) from ``onehot(target) - p`` and,
for an entropy bonus, ``-p * (log p + H)``. Peak memory holds one chunk's logits instead of the whole
sequence's logits and log-softmax; the arithmetic per token is that of :func:`miles.training.logprobs.
token_logprobs` (float32 after the head's GEMM in the activations' dtype), equal to float32 rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from miles.training.logit_masks import apply_logit_masks

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["DEFAULT_CHUNK_TOKENS", "fused_token_logprobs"]

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk: 1,024 x a 49k vocabulary is 200 MB of float32 logits at a time."""


def _chunks(total: int, size: int) -> Iterator[slice]:
    for start in range(0, total, size):
        yield slice(start, min(total, start + size))


def _scaled_chunk(
    hidden: torch.Tensor, weight: torch.Tensor, mask_ids: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """The chunk's float32 logits as :func:`miles.training.logprobs._scaled` sees them."""
    logits = apply_logit_masks((hidden @ weight.t()).float(), mask_ids)
    if temperature > 1e-6 and temperature != 1.0:
        logits = logits / temperature
    return logits


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """``-sum(p log p)`` over the last dim, with masked (``-inf``) ids contributing 0."""
    finite = logp.masked_fill(torch.isinf(logp), 0.0)
    return -(logp.exp() * finite).sum(-1)


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        mask_ids: torch.Tensor | None,
        temperature: float,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = hidden.shape[0]
        logprobs = torch.empty(total, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(total, dtype=torch.float32, device=hidden.device)
        for rows in _chunks(total, chunk_tokens):
            masks = mask_ids[rows] if mask_ids is not None else None
            logp = torch.log_softmax(_scaled_chunk(hidden[rows], weight, masks, temperature), dim=-1)
            logprobs[rows] = logp.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
            entropy[rows] = _entropy(logp)
        ctx.save_for_backward(hidden, weight, targets, entropy, *(() if mask_ids is None else (mask_ids,)))
        ctx.has_masks = mask_ids is not None
        ctx.set_materialize_grads(False)  # an unused entropy (a detached metric) costs no backward work
        ctx.temperature = temperature
        ctx.chunk_tokens = chunk_tokens
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, targets, entropy, *rest = ctx.saved_tensors
        mask_ids = rest[0] if ctx.has_masks else None
        temperature: float = ctx.temperature
        scale = 1.0 / temperature if temperature > 1e-6 and temperature != 1.0 else 1.0
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for rows in _chunks(hidden.shape[0], ctx.chunk_tokens):
            masks = mask_ids[rows] if mask_ids is not None else None
            logp = torch.log_softmax(_scaled_chunk(hidden[rows], weight, masks, temperature), dim=-1)
            p = logp.exp_()  # logp is not needed after this but for the entropy term, which recomputes it
            grad = torch.zeros_like(p)
            if grad_entropy is not None:  # d H / d scaled = -p (log p + H); masked ids (p = 0) get 0
                logp = torch.log(p).masked_fill_(p == 0, 0.0)
                grad = grad - grad_entropy[rows].float().unsqueeze(-1) * p * (logp + entropy[rows].unsqueeze(-1))
            if grad_logprobs is not None:  # d logprob / d scaled = onehot(target) - p
                g = grad_logprobs[rows].float().unsqueeze(-1)
                grad.sub_(p.mul_(g))
                grad.scatter_add_(-1, targets[rows].unsqueeze(-1), g)
            if scale != 1.0:
                grad.mul_(scale)
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad @ weight
            if ctx.needs_input_grad[1]:
                if grad.dtype == torch.float32:
                    grad_weight.addmm_(grad.t(), hidden[rows])
                else:
                    grad_weight += (grad.t() @ hidden[rows]).float()
        return grad_hidden, grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None, None, None


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    *,
    entropy_grad: bool = False,
    mask_ids: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`miles.training.logprobs.token_logprobs` of ``hidden @ weight.T`` (``[T, H]`` x ``[V, H]``)
    computed ``chunk_tokens`` tokens at a time, with gradients for ``hidden`` and ``weight``.

    The entropy carries gradients only with ``entropy_grad``; otherwise it is a detached metric.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"fused logprobs: chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"fused logprobs: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not match")
    if mask_ids is not None and not bool((mask_ids >= 0).any()):
        mask_ids = None
    if mask_ids is not None and int(mask_ids.max()) >= weight.shape[0]:
        raise ValueError(f"logit mask: token id {int(mask_ids.max())} is outside the vocabulary of {weight.shape[0]}")
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # the head's GEMM in the autocast dtype, as autocast runs nn.Linear
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    logprobs, entropy = _FusedLogprobs.apply(hidden, weight, targets, mask_ids, temperature, chunk_tokens)
    if not with_entropy:
        return logprobs, None
    return logprobs, entropy if entropy_grad else entropy.detach()
