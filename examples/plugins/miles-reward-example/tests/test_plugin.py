"""Tests of the ``keyword`` reward: conformance with Miles' reward interface, and scores on real samples."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

import miles_reward_example.plugin as plugin
from miles.plugins import PluginManager
from miles.settings.model import PluginSpec
from miles.testing import check_entry_point, check_light_import, check_plugin, check_reward, example_samples
from miles.types import Sample
from miles_reward_example import KeywordReward, KeywordRewardSettings


def _installed() -> bool:
    return any(ep.name == "reward_example" for ep in importlib.metadata.entry_points(group="miles.plugins"))


def _sample(response: str, label: object = None) -> Sample:
    return Sample(
        prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[-0.1], loss_mask=[1], response=response, label=label
    )


def _score(reward: KeywordReward, sample: Sample) -> float:
    return asyncio.run(reward.score(sample))


def test_plugin_conforms() -> None:
    (entry,) = check_plugin(plugin, name="reward_example", expect=[("reward", "keyword")])
    assert entry.component is KeywordReward
    assert entry.settings_model is KeywordRewardSettings


def test_reward_conforms_with_settings_keywords() -> None:
    values = check_reward(KeywordReward, settings={"keywords": ["answer", "42"]})
    # the kit's samples: "... The answer is \boxed{42}.", "", "Die Antwort ist ... (42) ✓", "Hello there!", "one two ..."
    assert values == [1.0, 0.0, 0.5, 0.0, 0.0]


def test_reward_conforms_with_label_keywords() -> None:
    labelled = [s for s in example_samples() if s.label is not None]
    values = check_reward(KeywordReward, samples=labelled)
    assert values == [1.0, 0.0, 1.0, 0.0]  # "42", "42", "42", "ten"


def test_plugin_module_imports_cheaply() -> None:
    check_light_import("miles_reward_example.plugin")


@pytest.mark.skipif(not _installed(), reason="miles-reward-example is not installed (pip install -e .)")
def test_entry_point() -> None:
    record = check_entry_point("reward_example", distribution="miles-reward-example")
    assert record.version == "0.1.0"
    assert ("reward", "keyword") in record.registers


@pytest.mark.skipif(not _installed(), reason="miles-reward-example is not installed (pip install -e .)")
def test_cli_lists_the_reward() -> None:
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("miles")), "plugins", "list", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    plugins = {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}
    entry = plugins["reward_example"]
    assert entry["distribution"] == "miles-reward-example"
    assert entry["status"] == "ok"
    assert {"kind": "reward", "name": "keyword"} in entry["registers"]


def test_selected_by_settings_through_the_manager() -> None:
    manager = PluginManager(builtins=(), entry_points=False, disabled=())
    manager.register(plugin, "reward_example")
    reward = manager.create(
        "reward", PluginSpec.model_validate({"name": "keyword", "keywords": ["Paris"]}), field="reward.functions[0]"
    )
    assert isinstance(reward, KeywordReward)
    assert _score(reward, _sample("The capital of France is Paris.")) == 1.0
    assert _score(reward, _sample("The capital of France is paris.")) == 1.0  # case-insensitive by default


def test_fraction_case_and_whole_words() -> None:
    reward = KeywordReward(KeywordRewardSettings(keywords=["cat", "Dog", "C++", "cat"]))
    assert _score(reward, _sample("A dog and a cat, written in c++.")) == 1.0
    assert _score(reward, _sample("concatenate the dogma")) == 0.0  # whole words only
    assert _score(reward, _sample("cat")) == pytest.approx(1 / 3)  # duplicates count once

    strict = KeywordReward(KeywordRewardSettings(keywords=["Dog", "cat"], case_sensitive=True))
    assert _score(strict, _sample("dog cat")) == 0.5
    substrings = KeywordReward(KeywordRewardSettings(keywords=["cat"], whole_words=False))
    assert _score(substrings, _sample("concatenate")) == 1.0


def test_keywords_from_label_forms() -> None:
    reward = KeywordReward(KeywordRewardSettings())
    assert _score(reward, _sample("red green", label=["red", "green", "blue", "pink"])) == 0.5
    assert _score(reward, _sample("über alles", label="über")) == 1.0
    assert _score(reward, _sample("x = 3", label={"keywords": ["x", "y"]})) == 0.5
    custom = KeywordReward(KeywordRewardSettings(label_field="must"))
    assert _score(custom, _sample("alpha", label={"must": ["alpha"]})) == 1.0


def test_missing_keywords_is_an_error_that_says_what_to_do() -> None:
    reward = KeywordReward(KeywordRewardSettings())
    with pytest.raises(ValueError, match="set `keywords` in the reward's settings"):
        _score(reward, _sample("anything", label=None))
    with pytest.raises(ValueError, match="blank"):
        _score(reward, _sample("anything", label=["  "]))


def test_unknown_setting_is_rejected() -> None:
    with pytest.raises(Exception, match="case_sensitiv"):
        KeywordRewardSettings.model_validate({"case_sensitiv": True})
