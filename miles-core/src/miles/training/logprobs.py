"""The per-token math every trainer applies to its logits, as the engine scores: the engine's logit masks,
logprobs and entropy at the sampling temperature, and the logprobs of given token ids (the teacher's top-k).

The masked logits set to ``-inf`` first (:mod:`miles.training.logit_masks`: EOS before ``min_new_tokens``),
then ``logits / temperature`` and ``log_softmax`` in float32; greedy decoding (``temperature`` 0) is scored at
temperature 1 (:func:`scoring_temperature` says which temperature the engine's reported logprobs have).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.training.logit_masks import apply_logit_masks

if TYPE_CHECKING:
    import torch

__all__ = ["scoring_temperature", "token_logprobs", "topk_logprobs"]


def scoring_temperature(temperature: float, *, top_k: int = -1, original_logprobs: bool = False) -> float:
    """The temperature of the distribution whose logprobs the engine reports for tokens sampled at
    ``temperature`` / ``top_k``: 1 for greedy decoding (temperature 0 or top-k 1) and for engines that report
    the raw logits' logprobs (``return_original_logprob``), else ``temperature``."""
    if temperature <= 1e-6 or top_k == 1 or original_logprobs:
        return 1.0
    return temperature


def _scaled(logits: torch.Tensor, temperature: float, mask_ids: torch.Tensor | None = None) -> torch.Tensor:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    scaled = apply_logit_masks(logits.float(), mask_ids)
    if temperature > 1e-6 and temperature != 1.0:
        scaled = scaled / temperature
    return scaled


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    *,
    entropy_grad: bool = False,
    mask_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each target (and the entropy of each distribution) from ``[T, V]`` logits.

    ``mask_ids`` (``[T, M]``, ``-1`` = none) are the token ids the engine masked out at each position
    (``TrainBatch.response_tensors[LOGIT_MASK_IDS]``); they get probability 0. The entropy carries
    gradients only with ``entropy_grad`` (an entropy bonus); otherwise it is a detached metric.
    """
    import torch

    logp_all = torch.log_softmax(_scaled(logits, temperature, mask_ids), dim=-1)
    logprobs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        source = logp_all if entropy_grad else logp_all.detach()
        # masked ids have probability 0 and logprob -inf: their term is 0, not nan
        finite = source.masked_fill(torch.isinf(source), 0.0) if mask_ids is not None else source
        entropy = -(source.exp() * finite).sum(-1)
    return logprobs, entropy


def topk_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[T, k]`` logprobs of the token ids ``ids`` (``[T, k]``) under ``log_softmax(logits / temperature)``,
    with gradient. Computed as ``gather - logsumexp`` so that no second ``[T, V]`` log-softmax is kept for
    backward."""
    import torch

    scaled = _scaled(logits, temperature)
    return scaled.gather(-1, ids) - torch.logsumexp(scaled, dim=-1, keepdim=True)
