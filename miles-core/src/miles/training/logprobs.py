"""The per-token math every trainer applies to its logits, as the engine scores: logprobs and entropy at
the sampling temperature, and the logprobs of given token ids (the teacher's top-k).

``logits / temperature``, then ``log_softmax`` in float32; greedy decoding (``temperature`` 0) is scored at
temperature 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["token_logprobs", "topk_logprobs"]


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scaled = logits.float()
    if temperature > 1e-6 and temperature != 1.0:
        scaled = scaled / temperature
    return scaled


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, *, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each target (and the entropy of each distribution) from ``[T, V]`` logits.

    The entropy carries gradients only with ``entropy_grad`` (an entropy bonus); otherwise it is a
    detached metric.
    """
    import torch

    logp_all = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    logprobs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        source = logp_all if entropy_grad else logp_all.detach()
        entropy = -(source.exp() * source).sum(-1)
    return logprobs, entropy


def topk_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[T, k]`` logprobs of the token ids ``ids`` (``[T, k]``) under ``log_softmax(logits / temperature)``,
    with gradient. Computed as ``gather - logsumexp`` so that no second ``[T, V]`` log-softmax is kept for
    backward."""
    import torch

    scaled = _scaled(logits, temperature)
    return scaled.gather(-1, ids) - torch.logsumexp(scaled, dim=-1, keepdim=True)
