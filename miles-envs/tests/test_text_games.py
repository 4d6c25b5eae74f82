"""textarena games through the Gymnasium text adapter: a real game played to its end (won by bisection, lost by
invalid moves), seeds that replay, and the ``text_game`` / ``gym_text`` settings refused naming the field."""

from __future__ import annotations

import re
from typing import Any

import pytest

from miles.errors import SettingsError
from miles_envs.gym_text.episode import GymTextRollout
from miles_envs.text_games.games import TextArenaEnv, TextGameRollout

from .conftest import resolve_function

pytest.importorskip("textarena")


def _bisect(env: TextArenaEnv, low: int, high: int) -> tuple[int, float, bool, list[str]]:
    """Play GuessTheNumber by bisection on its hints; the guesses' count, the final reward and whether it ended."""
    seen = []
    for turn in range(1, 20):
        guess = (low + high) // 2
        observation, reward, terminated, truncated, _ = env.step(f"My guess: [{guess}]")
        seen.append(observation)
        assert not truncated
        if terminated:
            return turn, reward, terminated, seen
        assert reward == 0.0
        hint = re.findall(r"The target number is (higher|lower)", observation)[-1]
        low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
    raise AssertionError("bisection did not end the game")


def test_a_game_is_won_by_bisection_and_replays_from_its_seed() -> None:
    env = TextArenaEnv("GuessTheNumber-v0", min_number=1, max_number=20, max_turns=10)
    first, info = env.reset(seed=11)
    assert "Guess The Number" in first and "between 1 and 20" in first and info == {}
    turns, reward, terminated, seen = _bisect(env, 1, 20)
    assert terminated and reward == 1.0 and turns <= 5
    assert "Congratulations" not in seen[0] or turns == 1  # (each observation holds only the new messages)

    import random

    random.seed(5)
    expected = random.random()
    random.seed(5)
    TextArenaEnv("GuessTheNumber-v0").reset(seed=99)
    assert random.random() == expected  # textarena's reseeding of the global stream does not leak out

    again = TextArenaEnv("GuessTheNumber-v0", min_number=1, max_number=20, max_turns=10)
    assert again.reset(seed=11)[0] == first
    assert _bisect(again, 1, 20)[0] == turns  # the same number, found in the same guesses


def test_invalid_moves_end_the_game_with_its_reward() -> None:
    env = TextArenaEnv("GuessTheNumber-v0", min_number=1, max_number=20, max_turns=10)
    env.reset(seed=3)
    observation, reward, terminated, _, _ = env.step("no brackets here")
    assert not terminated and reward == 0.0 and "invalid move" in observation.lower()
    observation, reward, terminated, _, info = env.step("still none")
    assert terminated and reward == 0.0 and info["invalid_move"] is True and "Invalid Move" in info["reason"]


def test_the_rollout_functions_resolve_with_their_settings() -> None:
    game = resolve_function({"name": "text_game", "game": "GuessTheNumber-v0", "options": {"max_number": 10}})
    assert isinstance(game.rollout_function, TextGameRollout) and game.rollout_function.settings.options == {
        "max_number": 10
    }
    env = game.rollout_function.make_env(None)
    assert "between 1 and 10" in env.reset(seed=0)[0]
    gym = resolve_function(
        {"name": "gym_text", "env": "miles_envs.text_games.games:TextArenaEnv", "kwargs": {"game": "Nim-v0"}}
    )
    assert isinstance(gym.rollout_function, GymTextRollout)


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ({"name": "text_game"}, r"rollout\.function\.game: required key is missing"),
        ({"name": "text_game", "game": "GuessTheNumbr-v0"}, r"rollout\.function\.game: textarena has no game"),
        ({"name": "text_game", "game": "TicTacToe-v0"}, r"rollout\.function\.game: 'TicTacToe-v0' is not a single-p"),
        ({"name": "text_game", "game": "GuessTheNumber-v0", "options": {"colour": 1}}, r"rollout\.function\.options"),
        ({"name": "gym_text", "env": "nope"}, r"rollout\.function\.env: expected 'package\.module:callable'"),
        ({"name": "gym_text", "env": "no_such_pkg_xyz:make"}, r"rollout\.function\.env: cannot import"),
        (
            {"name": "gym_text", "env": "miles_envs.text_games.games:TEXTARENA"},
            r"rollout\.function\.env: .* not callable",
        ),
    ],
)
def test_bad_games_and_factories_are_refused_naming_the_field(function: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        resolve_function(function)
