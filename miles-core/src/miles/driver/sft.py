"""Supervised fine-tuning batches: prompts and their target responses from the data set, no rollout.

Each row's prompt goes through the chat template (its ``prompt_ids`` are already set by the data
pipeline); the label is the target response, tokenised once and closed with the end-of-turn token.
Every response token is trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from miles.errors import DataError
from miles.types import Sample, SampleGroup, SampleStatus, WeightSpan

if TYPE_CHECKING:
    from miles.data.base import Prompt

__all__ = ["sft_groups"]


def _target_text(prompt: Prompt) -> str:
    label: Any = prompt.label
    if isinstance(label, dict):
        label = label.get("response", label.get("content"))
    if isinstance(label, list) and label and isinstance(label[-1], dict):  # chat messages: the last turn
        label = label[-1].get("content")
    if not isinstance(label, str) or not label:
        where = prompt.source or "?"
        raise DataError(f"{where}: SFT needs the target response as the label (a non-empty string), got {label!r}")
    return label


def sft_groups(
    prompts: Sequence[Prompt], tokenizer: Any, *, first_group_id: int, weight_version: int
) -> list[SampleGroup]:
    """One single-sample group per row."""
    eos = tokenizer.eos_token_id
    groups = []
    for i, prompt in enumerate(prompts):
        if prompt.prompt_ids is None:
            raise DataError(f"{prompt.source or '?'}: prompt was not tokenised")
        response_ids = list(tokenizer(_target_text(prompt), add_special_tokens=False)["input_ids"])
        if eos is not None:
            response_ids.append(int(eos))
        sample = Sample(
            prompt_ids=list(prompt.prompt_ids),
            response_ids=response_ids,
            rollout_logprobs=[0.0] * len(response_ids),
            loss_mask=[1] * len(response_ids),
            reward=0.0,
            status=SampleStatus.COMPLETED,
            group_id=first_group_id + i,
            prompt=prompt.text,
            prompt_messages=prompt.messages,
            label=prompt.label,
            weight_versions=[WeightSpan(0, len(response_ids), weight_version)],
            metadata=dict(prompt.metadata),
        )
        groups.append(SampleGroup(sample.group_id, [sample]))
    return groups
