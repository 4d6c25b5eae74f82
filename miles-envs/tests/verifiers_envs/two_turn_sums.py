"""A multi-turn verifiers environment for the tests: a sum is asked; the environment answers the first reply
with a follow-up question (add one more), and the episode ends after the second reply (``max_turns``) or as
soon as a reply holds the final answer.

Its rubric scores the episode: ``correct`` (weight 1: the last reply holds the final answer), ``brief``
(weight 0.5: the last reply is at most 12 characters), ``shortest`` (weight 0.25: a group-level function, which
scores all episodes of a prompt together: 1 for the episodes whose last reply is the shortest of the group) and
the ``num_turns`` metric verifiers adds to every multi-turn environment (weight 0). A random tiny model rarely
answers right but often replies briefly, so rewards differ within a group and GRPO has something to learn from.

It is an ordinary verifiers environment module: ``load_environment(**args)`` returns it, so ``data.path`` may
name this file, or its module name when its folder is on the path.
"""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset

FOLLOW_UP = "Now add one to it. Reply with the number only."


def _last_reply(completion: Any) -> str:
    replies = [m for m in completion if m.get("role") == "assistant"] if isinstance(completion, list) else []
    return str(replies[-1].get("content") or "") if replies else ""


def correct(completion: Any, answer: str) -> float:
    """1 when the last reply holds the final answer."""
    return 1.0 if answer in _last_reply(completion) else 0.0


def brief(completion: Any) -> float:
    """1 when the last reply is at most 12 characters."""
    return 1.0 if len(_last_reply(completion).strip()) <= 12 else 0.0


def shortest(completions: list[Any]) -> list[float]:
    """1 for the episodes whose last reply is the shortest of the group (ties share it), else 0."""
    lengths = [len(_last_reply(c).strip()) for c in completions]
    return [1.0 if n == min(lengths) else 0.0 for n in lengths]


class FollowUpEnv(vf.MultiTurnEnv):
    """Ask a sum, then ask to add one; stop when a reply holds the final answer."""

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        reply = _last_reply([m if isinstance(m, dict) else m.model_dump() for m in messages])
        if state["answer"] in reply:
            state["final_env_response"] = [vf.UserMessage(content="Correct.")]
            return state["final_env_response"]
        return [vf.UserMessage(content=FOLLOW_UP)]


def load_environment(num_examples: int = 8, max_turns: int = 2) -> vf.Environment:
    rows = [
        {"question": f"What is {a} + {b}?", "answer": str(a + b + 1), "info": {"a": a, "b": b}}
        for a, b in [(3, 4), (5, 2), (6, 1), (2, 2), (7, 3), (4, 4), (8, 1), (5, 5)][:num_examples]
    ]
    rubric = vf.Rubric(funcs=[correct, brief, shortest], weights=[1.0, 0.5, 0.25])
    return FollowUpEnv(
        dataset=Dataset.from_list(rows),
        system_prompt="Answer with a number.",
        rubric=rubric,
        max_turns=max_turns,
    )
