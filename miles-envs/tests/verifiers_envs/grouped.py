"""A verifiers environment whose rubric has a group-level reward function (Miles refuses it)."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def rank_in_group(completions: list[object]) -> list[float]:
    """Scores the rollouts of a prompt together."""
    return [float(i) for i in range(len(completions))]


def load_environment() -> vf.Environment:
    dataset = Dataset.from_list([{"question": "Say hi.", "answer": "hi"}])
    return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[rank_in_group]))
