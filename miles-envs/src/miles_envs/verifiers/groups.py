"""Scoring the episodes of a GRPO group together, for a rubric with group-level reward functions.

A verifiers rubric's group function (plural arguments such as ``completions`` or ``states``, or a list
returned: verifiers' ``Rubric._is_group_func``) scores all rollouts of a prompt together — a rank within the
group, "1 for the shortest answer of the group". Such an environment's episode is not scored when it ends: the
``verifiers`` rollout function keeps its verifiers state here (:data:`PENDING`, under a key it writes to the
sample's ``metadata["verifiers"]["pending"]``), and the ``verifiers`` reward — a
:class:`~miles.rewards.base.GroupReward`, which the rollout manager calls once per group when all its episodes
are played — hands the group's states to the rubric's ``score_group`` (:func:`score_pending`), as verifiers'
own ``run_group`` does: its individual functions score each state, its group functions all of them. The
rubric's cleanup then runs on each state.

A sample that does not reach scoring (an infrastructure error, an episode that recorded nothing, an aborted
attempt) is not in the group: its state is cleaned up when the rollout function returns it, and the sample
stays failed with its reason. States are held in the process that played the episodes (the driver, where the
rollout manager also scores them); whatever is still held when the rollout function closes is cleaned up.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from miles.types import Sample

__all__ = [
    "PENDING",
    "PendingStates",
    "StateGoneError",
    "held_states",
    "hold",
    "release",
    "rubric_scores",
    "score_pending",
]

log = logging.getLogger(__name__)


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def rubric_scores(state: Any) -> dict[str, Any]:
    """What a scored state gives the sample's ``metadata["verifiers"]``: ``reward`` (``None`` when not a
    finite number) and each function's finite value in ``metrics``."""
    numbers = {str(k): _number(v) for k, v in (state.get("metrics") or {}).items()}
    return {"reward": _number(state.get("reward")), "metrics": {k: v for k, v in numbers.items() if v is not None}}


class PendingStates:
    """The states of played episodes that wait for their group to be scored, each under a key of its own."""

    def __init__(self) -> None:
        self._states: dict[str, tuple[Any, Any]] = {}

    def put(self, env: Any, state: Any) -> str:
        """Hold ``env``'s ``state``; the key to take it back with."""
        key = uuid.uuid4().hex
        self._states[key] = (env, state)
        return key

    def take(self, key: str) -> tuple[Any, Any] | None:
        """The environment and state held under ``key`` (no longer held), or ``None``."""
        return self._states.pop(key, None)

    def __len__(self) -> int:
        return len(self._states)

    async def clear(self) -> None:
        """Clean up every state still held (the rubric's cleanup) and forget them."""
        states, self._states = list(self._states.values()), {}
        if states:
            log.info("cleaning up %d verifiers episode state(s) whose group was never scored", len(states))
        for env, state in states:
            await env.rubric.cleanup(state)


PENDING = PendingStates()
"""The process's episodes waiting for their group's scoring."""

_PLAYED: ContextVar[list[tuple[Any, Any]] | None] = ContextVar("miles_verifiers_played", default=None)


def held_states() -> tuple[list[tuple[Any, Any]], Any]:
    """A fresh list for the episode played in this context to :func:`hold` its state in, and the context token
    to reset it with (the rollout function's call)."""
    played: list[tuple[Any, Any]] = []
    return played, _PLAYED.set(played)


def release(token: Any) -> None:
    """Undo :func:`held_states`."""
    _PLAYED.reset(token)


def hold(env: Any, state: Any) -> bool:
    """Keep ``state`` for its group's scoring: ``False`` when no rollout function call is listening (the episode
    was played outside the ``verifiers`` rollout function)."""
    played = _PLAYED.get()
    if played is None:
        return False
    played.append((env, state))
    return True


class StateGoneError(LookupError):
    """A sample's episode state is not held by this process."""


async def score_pending(samples: Sequence[Sample]) -> dict[int, Exception]:
    """Score the samples of one group whose episodes wait for it (``metadata["verifiers"]["pending"]``): the
    states of each environment go to its rubric's ``score_group`` together, then each state is cleaned up, and
    each sample's ``metadata["verifiers"]`` gets its ``reward`` and ``metrics``. Returns the samples (by index)
    that cannot be scored, with why: their state is not held here."""
    failures: dict[int, Exception] = {}
    by_env: dict[int, tuple[Any, list[tuple[int, Any]]]] = {}
    for i, sample in enumerate(samples):
        info = sample.metadata.get("verifiers")
        key = info.pop("pending", None) if isinstance(info, dict) else None
        if key is None:
            continue
        held = PENDING.take(str(key))
        if held is None:
            failures[i] = StateGoneError(
                "the episode's verifiers state is not held by this process (scored already, or played by another "
                "process), so the rubric's group functions cannot score it"
            )
            continue
        env, state = held
        by_env.setdefault(id(env), (env, []))[1].append((i, state))
    groups = list(by_env.values())
    done = 0  # environments whose states are cleaned up
    try:
        for env, members in groups:
            states = [state for _, state in members]
            try:
                await env.rubric.score_group(states)
            finally:
                done += 1
                for state in states:
                    await env.rubric.cleanup(state)
            for i, state in members:
                samples[i].metadata["verifiers"].update(rubric_scores(state))
    finally:  # scoring raised or timed out: the states it did not reach are cleaned up too
        for env, members in groups[done:]:
            for _, state in members:
                await env.rubric.cleanup(state)
    return failures
