"""The PPO critic: the policy's ``GPTModel`` with its output layer replaced by a scalar value head.

As in slime and verl, the critic is a second ``GPTModel`` built and loaded from the same HF checkpoint
(so its backbone starts as the policy's), whose last pipeline stage swaps the vocabulary-parallel output
layer for :class:`ValueHead`: one weight row ``[1, hidden]``, replicated over tensor parallel, applied to
the final-norm hidden state of every position — the same critic as miles-fsdp's ``ValueModel`` (the HF
decoder's ``last_hidden_state`` times a bias-free ``Linear(hidden, 1)``), initialised the same way from
the same seed, so the two backends train it to the same numbers.

Under sequence parallel each tensor-parallel rank holds a slice of the positions: the head runs on its
slice and the values (one float per token) are all-gathered; the gather's backward keeps each rank's own
slice, and the head's weight is tagged ``sequence_parallel`` so that Megatron sums its gradient over the
tensor-parallel group.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ValueHead", "attach_value_head", "value_head_weight"]


def value_head_weight(hidden_size: int, *, init_std: float, seed: int) -> torch.Tensor:
    """The head's initial ``[1, hidden]`` weight: zeros, or ``normal(0, init_std)`` drawn exactly as
    miles-fsdp draws it (``manual_seed(seed + 1)``, a fresh ``nn.Linear``, then ``normal_``), without
    touching this process's RNG state."""
    if init_std <= 0:
        return torch.zeros(1, hidden_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        linear = torch.nn.Linear(hidden_size, 1, bias=False)
        torch.nn.init.normal_(linear.weight, std=init_std)
    return linear.weight.detach().clone()


class ValueHead(torch.nn.Module):
    """``values = hidden @ weight.T`` per position, called where ``GPTModel`` calls its output layer.

    :param weight: the initial ``[1, hidden]`` weight (see :func:`value_head_weight`).
    :param sequence_parallel: the hidden states arrive split along the sequence over tensor parallel.
    """

    def __init__(self, weight: torch.Tensor, *, sequence_parallel: bool, dtype: torch.dtype) -> None:
        super().__init__()
        from megatron.core import tensor_parallel

        self.weight = torch.nn.Parameter(weight.to(dtype=dtype, copy=True))
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(self.weight)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """``[s, b, h]`` hidden states (``s`` this rank's slice under sequence parallel) -> ``[S, b, 1]``
        values in float32, every position; ``GPTModel``'s tied output ``weight`` is ignored."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        values = torch.nn.functional.linear(hidden_states, self.weight.to(hidden_states.dtype)).float()
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def attach_value_head(model: Any, hf_config: Any, *, init_std: float, seed: int) -> None:
    """Turn a loaded policy ``GPTModel`` (one pipeline stage) into the critic, in place.

    The last stage's output layer becomes a :class:`ValueHead`; every stage stops sharing the embedding
    with the output layer (the critic has no vocabulary projection, so there is no tied gradient to
    all-reduce between the first and last stages).
    """
    model.share_embeddings_and_output_weights = False
    if not model.post_process:
        return
    hidden = int(hf_config.hidden_size)
    model.output_layer = ValueHead(
        value_head_weight(hidden, init_std=init_std, seed=seed),
        sequence_parallel=bool(model.config.sequence_parallel),
        dtype=model.config.params_dtype,
    )
