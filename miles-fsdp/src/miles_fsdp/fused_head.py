"""The LM head of a Hugging Face causal LM computing token logprobs in place of logits (``fused_logprobs``).

:class:`FusedHead` gives the model's output embedding (``lm_head``) a forward that, while a request is
open (:meth:`FusedHead.scoring`), returns ``[1, T, 2]`` = (logprob of each target, entropy) computed by
:func:`miles_fsdp.fused_logprobs.fused_token_logprobs` from the hidden states the model hands its head,
instead of the ``[1, T, V]`` logits. The model's own forward runs unchanged around it (so FSDP gathers and
reduces the head's weight, tied to the embedding or not, as it does for the logits); outside a request the
head is the plain linear. Parameter names and the state dict are untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from miles_fsdp.fused_logprobs import fused_token_logprobs

if TYPE_CHECKING:
    from torch import nn

__all__ = ["FusedHead", "unsupported_reason"]

log = logging.getLogger(__name__)

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config fields of models whose forward transforms the head's output (the fused head would skip it)."""


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model``'s head cannot be fused (``None``: it can): a head with a bias, no ``nn.Linear`` head,
    or a model that rescales / soft-caps its logits after the head."""
    from torch import nn

    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if not isinstance(head, nn.Linear):
        return f"{type(model).__name__} has no nn.Linear output embedding"
    if head.bias is not None:
        return "the LM head has a bias"
    config = getattr(model, "config", None)
    for field in _LOGIT_TRANSFORMS:
        if getattr(config, field, None) not in (None, 1.0):
            return f"the model's config sets {field} (its logits are transformed after the head)"
    return None


@dataclass
class _Request:
    targets: torch.Tensor
    temperature: float
    mask_ids: torch.Tensor | None
    entropy_grad: bool


class FusedHead:
    """Installed on ``model``'s output embedding; :meth:`scoring` turns its output into logprobs + entropy."""

    def __init__(self, model: nn.Module, *, chunk_tokens: int) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise TypeError(f"[train.backend] fused_logprobs: {reason}; set fused_logprobs = false")
        self.head: Any = model.get_output_embeddings()
        self.chunk_tokens = chunk_tokens
        self._request: _Request | None = None
        self._linear_forward = self.head.forward
        self.head.forward = self._forward

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        request = self._request
        if request is None:
            return self._linear_forward(hidden)
        flat = hidden.reshape(-1, hidden.shape[-1])
        logprobs, entropy = fused_token_logprobs(
            flat,
            self.head.weight,
            request.targets,
            request.temperature,
            True,
            entropy_grad=request.entropy_grad,
            mask_ids=request.mask_ids,
            chunk_tokens=self.chunk_tokens,
        )
        assert entropy is not None
        return torch.stack([logprobs, entropy], dim=-1).reshape(*hidden.shape[:-1], 2)

    @contextmanager
    def scoring(
        self, targets: torch.Tensor, temperature: float, mask_ids: torch.Tensor | None, *, entropy_grad: bool
    ) -> Iterator[None]:
        """While open, the head returns ``[..., 2]`` (logprob of ``targets``, entropy) for its ``T`` rows."""
        self._request = _Request(targets, temperature, mask_ids, entropy_grad)
        try:
            yield
        finally:
            self._request = None

    def remove(self) -> None:
        """Give the head back its plain linear forward."""
        self.head.forward = self._linear_forward
