"""``LetterHunt``: a small OpenEnv environment for examples and tests (it needs nothing but openenv-core).

Each turn the environment names a letter; the reply earns 1.0 when it contains that letter (any case), else
0.0. An episode is ``turns`` letters long (3 by default), drawn from the ``reset`` seed, so the episodes of one
seed ask for the same letters. Serve it with ``env = "miles_envs.openenv.letters:LetterHunt"``.
"""

from __future__ import annotations

import random
import string
import uuid
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State

__all__ = ["LetterAction", "LetterHunt", "LetterObservation"]


class LetterAction(Action):
    """The player's reply."""

    message: str


class LetterObservation(Observation):
    """What the player reads: the task, then how the last reply fared."""

    prompt: str


class LetterHunt(Environment[LetterAction, LetterObservation, State]):
    """Reply with a text that contains the letter asked for; one letter per turn."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, turns: int = 3) -> None:
        super().__init__()
        self.turns = turns
        self._letters: list[str] = []
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> LetterObservation:
        rng = random.Random(seed)
        self._letters = [rng.choice(string.ascii_lowercase[:8]) for _ in range(self.turns)]
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return LetterObservation(prompt=f"Write a word that contains the letter '{self._letters[0]}'.")

    def step(self, action: LetterAction, timeout_s: float | None = None, **kwargs: Any) -> LetterObservation:
        turn = self._state.step_count
        if turn >= len(self._letters):
            raise RuntimeError("the episode is over: reset first")
        found = self._letters[turn] in action.message.lower()
        self._state.step_count = turn + 1
        done = self._state.step_count >= len(self._letters)
        verdict = "Yes." if found else "No."
        prompt = verdict if done else f"{verdict} Now a word with the letter '{self._letters[turn + 1]}'."
        return LetterObservation(prompt=prompt, reward=1.0 if found else 0.0, done=done)

    @property
    def state(self) -> State:
        return self._state
