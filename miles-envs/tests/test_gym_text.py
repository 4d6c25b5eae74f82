"""The plugins of the gym_text, openenv and text_games subpackages: what each registers, their entry modules'
imports, and the ``env_return`` reward."""

from __future__ import annotations

import asyncio

import pytest

import miles_envs.gym_text.plugin as gym_plugin
import miles_envs.openenv.plugin as openenv_plugin
import miles_envs.text_games.plugin as text_games_plugin
from miles.testing import check_light_import, check_plugin, check_reward, check_rollout_function
from miles.types import Sample
from miles_envs.gym_text.reward import EnvReturn


@pytest.mark.parametrize(
    ("plugin", "name", "expect"),
    [
        (gym_plugin, "gym_text", [("rollout_function", "gym_text"), ("reward", "env_return")]),
        (openenv_plugin, "openenv", [("rollout_function", "openenv")]),
        (text_games_plugin, "text_games", [("rollout_function", "text_game")]),
    ],
)
def test_the_plugins_conform_and_import_no_environment_library(
    plugin: object, name: str, expect: list[tuple[str, str]]
) -> None:
    entries = check_plugin(plugin, name=name, expect=expect)
    if name == "text_games":
        (entry,) = entries
        check_rollout_function(entry.component(entry.settings_model(game="GuessTheNumber-v0")), name="text_game")
    check_light_import(
        f"miles_envs.{name}.plugin",
        forbidden=("torch", "transformers", "openai", "openenv", "textarena", "websockets", "verifiers"),
    )


def _played(rewards: list[float] | None, terminated: bool = True) -> Sample:
    metadata = {} if rewards is None else {"env_rewards": rewards, "env_terminated": terminated}
    return Sample(prompt_ids=[1], response_ids=[2], metadata=metadata)


def test_env_return_is_the_episodes_rewards() -> None:
    samples = [_played([0.0, 1.0, 0.5]), _played([]), _played([2.0], terminated=False)]
    assert check_reward(EnvReturn, samples=samples) == [1.5, 0.0, 2.0]
    assert check_reward(EnvReturn, settings={"aggregate": "last"}, samples=samples) == [0.5, 0.0, 2.0]
    assert check_reward(EnvReturn, settings={"aggregate": "mean"}, samples=samples) == [0.5, 0.0, 2.0]


def test_env_return_refuses_a_sample_that_played_no_environment() -> None:
    with pytest.raises(ValueError, match="env_return: the sample has no env_rewards"):
        asyncio.run(EnvReturn(EnvReturn.Settings()).score(_played(None)))
