"""A multi-turn verifiers environment whose rubric has group-level reward functions, and whose infrastructure
fails the first episode that reaches a second turn (``vf.SandboxError``, an ``InfraError``: Miles fails that
sample): the group functions score the group's other episodes together.

Its rubric: ``replied`` (weight 1, one rollout: 1 when the episode has a reply), ``length_rank`` (weight 0.5, the
group's: how many episodes of the group wrote fewer reply characters than this one) and ``group_size`` (weight 0,
the group's: how many episodes the group function saw).
"""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset


def reply_length(completion: Any) -> int:
    """The characters of every reply of the episode."""
    return sum(len(str(m.get("content") or "")) for m in completion if m.get("role") == "assistant")


def replied(completion: Any) -> float:
    """1 when the episode has a reply."""
    return 1.0 if any(m.get("role") == "assistant" for m in completion) else 0.0


def length_rank(completions: list[Any]) -> list[float]:
    """How many episodes of the group wrote fewer reply characters than this one."""
    lengths = [reply_length(c) for c in completions]
    return [float(sum(other < n for other in lengths)) for n in lengths]


def group_size(states: list[Any]) -> list[float]:
    """How many episodes the group function scores together."""
    return [float(len(states))] * len(states)


class FlakyEnv(vf.MultiTurnEnv):
    """Asks a follow-up after the first reply; the sandbox of the first episode to get there is gone."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failed = False

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        if not self.failed:
            self.failed = True
            raise vf.SandboxError("the sandbox is gone")
        return [vf.UserMessage(content="And once more?")]


def load_environment() -> vf.Environment:
    dataset = Dataset.from_list([{"question": "Say hi.", "answer": "hi"}])
    rubric = vf.Rubric(funcs=[replied, length_rank, group_size], weights=[1.0, 0.5, 0.0])
    return FlakyEnv(dataset=dataset, rubric=rubric, max_turns=2)
