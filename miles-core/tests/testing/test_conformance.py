"""Tests of the plugin-level conformance checks: conforming plugins (every real built-in and small real
plugins written here) pass; each way of not conforming fails with a message that names it."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import miles
import miles.metrics.jsonl
import miles.precision.builtin
from miles.components import ComponentKind, ComponentSettings
from miles.metrics.jsonl import JsonlLogger
from miles.plugins.builtin import BUILTIN_PLUGINS
from miles.precision.builtin import BF16, FP32
from miles.rewards.base import Reward
from miles.testing import (
    check_algorithm,
    check_data_source,
    check_entry_point,
    check_light_import,
    check_logger,
    check_plugin,
    check_precision,
    check_reward,
    check_settings_model,
    check_transport,
    example_samples,
)
from miles.testing.plugins import LengthReward, plugin_of, registering


def test_builtin_plugins_conform(tmp_path: Path) -> None:
    precisions = check_plugin(
        miles.precision.builtin, name="precision", expect=[("precision", "fp32"), ("precision", "bf16")]
    )
    assert {e.name for e in precisions} == {"fp32", "bf16"}
    check_precision(FP32)
    check_precision(BF16)
    (logger,) = check_plugin(miles.metrics.jsonl, name="jsonl", expect=[("logger", "jsonl")])
    run_dir = check_logger(logger.component, tmp_path)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["train/grad_norm"] is None and rows[0]["train/loss"] == 1.5


# -- plugin-level failures --------------------------------------------------------------------------


class BadName(LengthReward):
    """A reward with an invalid name."""

    name = "Bad Name"


def test_bad_name_fails() -> None:
    with pytest.raises(AssertionError, match=r"plugin 'p'.*invalid name 'Bad Name'"):
        check_plugin(registering("miles_register_rewards", BadName), name="p")


def test_unknown_hook_fails() -> None:
    typo = registering("miles_register_reward", LengthReward)  # missing the final "s"
    with pytest.raises(AssertionError, match=r"plugin 'typo'.*unknown hook.*miles_register_reward\b"):
        check_plugin(typo, name="typo")


def test_undecorated_hook_fails() -> None:
    def miles_register_rewards(register: Any) -> None:
        register(LengthReward)

    with pytest.raises(AssertionError, match=r"plugin 'p'.*miles_register_rewards not decorated with @miles.hookimpl"):
        check_plugin(plugin_of(miles_register_rewards=miles_register_rewards), name="p")


def test_plugin_without_hooks_fails() -> None:
    with pytest.raises(AssertionError, match="plugin 'empty': implements no Miles hook"):
        check_plugin(plugin_of(helper=lambda: None), name="empty")


def test_hook_with_unknown_argument_fails() -> None:
    @miles.hookimpl
    def miles_register_rewards(register: Any, settings: Any) -> None:
        register(LengthReward)

    with pytest.raises(
        AssertionError,
        match=r"plugin 'p': miles_register_rewards asks for argument\(s\) settings that the hook does not provide \(it provides: register\)",
    ):
        check_plugin(plugin_of(miles_register_rewards=miles_register_rewards), name="p")


def test_registration_hook_that_raises_fails() -> None:
    @miles.hookimpl
    def miles_register_rewards(register: Any) -> None:
        raise RuntimeError("cannot reach the grader")

    with pytest.raises(
        AssertionError, match=r"plugin 'p'.*miles_register_rewards: RuntimeError: cannot reach the grader"
    ):
        check_plugin(plugin_of(miles_register_rewards=miles_register_rewards), name="p")


def test_name_taken_by_a_builtin_fails() -> None:
    class MyJsonl(JsonlLogger):
        """Another jsonl logger."""

    with pytest.raises(AssertionError, match=r"logger 'jsonl' is registered by both plugin 'jsonl' and plugin 'mine'"):
        check_plugin(registering("miles_register_loggers", MyJsonl), name="mine")


def test_impure_registration_hook_fails() -> None:
    calls = []

    @miles.hookimpl
    def miles_register_rewards(register: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            register(LengthReward)

    with pytest.raises(AssertionError, match="plugin 'p': registration hooks register different components"):
        check_plugin(plugin_of(miles_register_rewards=miles_register_rewards), name="p")


def test_missing_expected_registration_fails() -> None:
    with pytest.raises(
        AssertionError, match=r"plugin 'p': does not register reward 'keyword' \(registers reward 'length'\)"
    ):
        check_plugin(registering("miles_register_rewards", LengthReward), name="p", expect=[("reward", "keyword")])


def test_wrong_base_class_fails() -> None:
    with pytest.raises(
        AssertionError,
        match=r"plugin 'p', transport 'length'.*must be a class deriving from miles.transport.base.WeightTransport",
    ):
        check_plugin(registering("miles_register_transports", LengthReward), name="p")


def test_abstract_component_fails() -> None:
    class Half(Reward):
        """A reward that forgot score."""

        name = "half"

    with pytest.raises(
        AssertionError, match=r"plugin 'p', reward 'half'.*does not implement the abstract method\(s\) score"
    ):
        check_plugin(registering("miles_register_rewards", Half), name="p")


def test_missing_docstring_fails() -> None:
    class Quiet(LengthReward):
        name = "quiet"

    with pytest.raises(AssertionError, match=r"reward 'quiet'.*has no docstring"):
        check_plugin(registering("miles_register_rewards", Quiet), name="p")


# -- settings models --------------------------------------------------------------------------------


def test_undocumented_settings_field_fails() -> None:
    class Undocumented(ComponentSettings):
        """Settings."""

        threshold: float = 0.5

    class R(LengthReward):
        """A reward."""

        name = "undocumented"
        Settings = Undocumented

    with pytest.raises(AssertionError, match=r"plugin 'p', reward 'undocumented'.*field 'threshold' has no docstring"):
        check_plugin(registering("miles_register_rewards", R), name="p")


def test_settings_field_documented_by_description_passes() -> None:
    class Described(ComponentSettings):
        """Settings."""

        threshold: float = Field(0.5, description="Cut-off.")

    check_settings_model(Described)


def test_settings_accepting_unknown_keys_fails() -> None:
    class Loose(BaseModel):
        """Settings."""

        model_config = ConfigDict(use_attribute_docstrings=True)
        threshold: float = 0.5
        """Cut-off."""

    with pytest.raises(AssertionError, match="Settings .*Loose accepts unknown keys"):
        check_settings_model(Loose, where="reward 'x'")


def test_settings_default_that_does_not_validate_fails() -> None:
    class BadDefault(ComponentSettings):
        """Settings."""

        retries: int = Field(0, ge=1)
        """Attempts."""

    with pytest.raises(
        AssertionError,
        match=r"default of field 'retries' \(0\) does not validate: Input should be greater than or equal to 1",
    ):
        check_settings_model(BadDefault)


def test_required_settings_need_explicit_settings() -> None:
    class Needs(ComponentSettings):
        """Settings."""

        url: str
        """Grader URL."""

    class Remote(LengthReward):
        """A reward with a required setting."""

        name = "remote"
        Settings = Needs  # type: ignore[assignment]

    with pytest.raises(AssertionError, match=r"reward 'remote'.*settings do not validate \(pass settings="):
        check_reward(Remote)


# -- entry points and import cost -------------------------------------------------------------------


def test_missing_entry_point_fails() -> None:
    with pytest.raises(AssertionError, match="entry point 'no_such_plugin' .*not installed"):
        check_entry_point("no_such_plugin")


@pytest.mark.skipif(
    not any(ep.name == "reward_example" for ep in importlib.metadata.entry_points(group="miles.plugins")),
    reason="examples/plugins/miles-reward-example is not installed",
)
def test_installed_example_entry_point_passes() -> None:
    record = check_entry_point("reward_example", distribution="miles-reward-example")
    assert record.registers == [("reward", "keyword")]
    with pytest.raises(AssertionError, match="provided by miles-reward-example, expected distribution 'other'"):
        check_entry_point("reward_example", distribution="other")


def test_light_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check_light_import("miles.metrics.jsonl")
    (tmp_path / "heavy_plugin.py").write_text("import torch\n\nVALUE = torch.zeros(1)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(AssertionError, match=r"plugin module 'heavy_plugin': importing it imports torch"):
        check_light_import("heavy_plugin")
    with pytest.raises(AssertionError, match=r"plugin module 'no_such_module': import fails"):
        check_light_import("no_such_module")


GOOD_PLUGIN = '''
import miles
from miles.precision.base import PrecisionRecipe


class Half(PrecisionRecipe):
    """float16 compute."""

    name = "fp16_test"
    param_dtype = "float16"


@miles.hookimpl
def miles_register_precisions(register):
    register(Half)
'''


def test_entry_point_of_an_installed_distribution(fake_distribution: Any) -> None:
    fake_distribution(
        "miles-fp16-test", {"fp16_test": "miles_fp16_test_plugin"}, {"miles_fp16_test_plugin": GOOD_PLUGIN}
    )
    record = check_entry_point("fp16_test", distribution="miles-fp16-test")
    assert (record.distribution, record.version, record.registers) == (
        "miles-fp16-test",
        "0.3.1",
        [("precision", "fp16_test")],
    )


def test_entry_point_that_fails_to_import(fake_distribution: Any) -> None:
    fake_distribution(
        "miles-broken-test",
        {"broken_test": "miles_broken_test_plugin"},
        {"miles_broken_test_plugin": "import no_such_dependency\n"},
    )
    with pytest.raises(
        AssertionError,
        match=r"entry point 'broken_test'.*loads with status failed: ModuleNotFoundError: No module named 'no_such_dependency'",
    ):
        check_entry_point("broken_test")


# -- every built-in plugin passes the kit ---------------------------------------------------------------


def _task_samples() -> list[Any]:
    """The kit's samples for the ``reasoning_gym`` reward, whose labels are the library's task entries (its data
    source puts them there; another label fails the sample, by design): real entries, answered right, wrong,
    empty and in another script; none without the library installed (the reward then refuses to load)."""
    if importlib.util.find_spec("reasoning_gym") is None:
        return []
    import reasoning_gym

    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=0))
    responses = [
        f"<answer>{entries[0]['answer']}</answer>",
        "<answer>banana</answer>",
        "",
        "Antwort: <answer>✓</answer>",
    ]
    samples = example_samples()[:4]
    for sample, entry, response in zip(samples, entries, responses, strict=True):
        sample.label, sample.response = {"entry": entry, "answer": entry["answer"]}, response
    return samples


@pytest.mark.parametrize(("plugin_name", "module"), BUILTIN_PLUGINS, ids=[n for n, _ in BUILTIN_PLUGINS])
def test_builtin_plugin_conforms(plugin_name: str, module: str, tmp_path: Path) -> None:
    """The same checks third parties run, applied to each of Miles' own built-in plugins: the plugin as a
    whole, then each component whose settings have usable defaults against its kind's interface."""
    check_light_import(module)
    entries = check_plugin(importlib.import_module(module), name=plugin_name)
    assert entries, f"built-in plugin {plugin_name!r} registers nothing"
    for entry in entries:
        try:
            entry.settings_model.model_validate({})
        except ValidationError:
            continue  # needs settings (a URL, a pattern ...): covered by the component's own tests
        if entry.kind is ComponentKind.REWARD:
            samples = _task_samples() if entry.name == "reasoning_gym" else example_samples()
            if samples:
                assert len(check_reward(entry.component, samples=samples)) == len(samples)
        elif entry.kind is ComponentKind.ALGORITHM:
            check_algorithm(entry.component)
        elif entry.kind is ComponentKind.PRECISION:
            check_precision(entry.component)
        elif entry.kind is ComponentKind.TRANSPORT:
            check_transport(entry.component, tmp_path / entry.name)
        elif entry.kind is ComponentKind.LOGGER:
            check_logger(entry.component, tmp_path / entry.name)
        elif entry.kind is ComponentKind.DATA_SOURCE and entry.name == "jsonl":
            path = tmp_path / "prompts.jsonl"
            path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(5)))
            check_data_source(entry.component, path)
