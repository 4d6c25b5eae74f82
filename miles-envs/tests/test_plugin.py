"""The ``envs`` plugin: what it registers, its entry module's imports, and the ``env_return`` reward."""

from __future__ import annotations

import asyncio

import pytest

import miles_envs.plugin as plugin
from miles.testing import check_light_import, check_plugin, check_reward, check_rollout_function
from miles.types import Sample
from miles_envs.rewards import EnvReturn


def test_the_plugin_conforms_and_imports_no_environment_library() -> None:
    entries = check_plugin(
        plugin,
        name="envs",
        expect=[
            ("rollout_function", "openenv"),
            ("rollout_function", "text_game"),
            ("rollout_function", "gym_text"),
            ("reward", "env_return"),
        ],
    )
    functions = {e.name: e for e in entries if e.kind.value == "rollout_function"}
    game = functions["text_game"].component(functions["text_game"].settings_model(game="GuessTheNumber-v0"))
    check_rollout_function(game, name="text_game")
    check_light_import(
        "miles_envs.plugin", forbidden=("torch", "transformers", "openai", "openenv", "textarena", "websockets")
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
