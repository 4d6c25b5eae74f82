"""A verifiers environment whose ``env_response`` fails after the first model turn: with an infrastructure
error (``vf.SandboxError``, an ``InfraError``: Miles fails the sample) or a tool error (``vf.ToolCallError``:
verifiers ends the episode and its rubric scores what was played)."""

from __future__ import annotations

from typing import Any, Literal

import verifiers as vf
from datasets import Dataset


def replied(completion: Any) -> float:
    """1 when the episode has a reply."""
    return 1.0 if any(m.get("role") == "assistant" for m in completion) else 0.0


class FailingEnv(vf.MultiTurnEnv):
    """Fails in env_response with the configured error."""

    def __init__(self, kind: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kind = kind

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        if self.kind == "infra":
            raise vf.SandboxError("the sandbox is gone")
        raise vf.ToolCallError("the tool crashed")


def load_environment(kind: Literal["infra", "tool"] = "infra") -> vf.Environment:
    dataset = Dataset.from_list([{"question": "What is 2 + 2?", "answer": "4"}])
    return FailingEnv(kind, dataset=dataset, rubric=vf.Rubric(funcs=[replied]), max_turns=3)
