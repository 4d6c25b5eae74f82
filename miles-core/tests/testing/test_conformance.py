"""Tests of the plugin conformance kit: conforming plugins (the real built-ins and small real plugins
written here) pass; each way of not conforming fails with a message that names it."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import random
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import miles
import miles.metrics.jsonl
import miles.precision.builtin
from miles.algorithms.base import Algorithm, LossInputs, LossOutput
from miles.components import ComponentKind, ComponentSettings
from miles.data.base import DataSource, Prompt
from miles.metrics.base import MetricsLogger
from miles.metrics.jsonl import JsonlLogger
from miles.plugins.builtin import BUILTIN_PLUGINS
from miles.precision.base import PrecisionRecipe
from miles.precision.builtin import BF16, FP32
from miles.rewards.base import Reward, RewardOutput
from miles.testing import (
    check_algorithm,
    check_data_source,
    check_entry_point,
    check_light_import,
    check_logger,
    check_plugin,
    check_precision,
    check_reward,
    check_rollout_function,
    check_settings_model,
    check_transport,
    example_groups,
    example_samples,
)
from miles.transport.base import PushReport, WeightTransport
from miles.types import Sample

# -- a conforming reward plugin -----------------------------------------------------------------------


class LengthSettings(ComponentSettings):
    """Settings of the ``length`` reward."""

    target: int = Field(8, ge=1)
    """Target response length in words."""


class LengthReward(Reward):
    """1.0 at the target length, falling linearly to 0.0 at twice (or zero times) the target."""

    name = "length"
    Settings = LengthSettings

    async def score(self, sample: Sample) -> RewardOutput:
        assert isinstance(self.settings, LengthSettings)
        words = len(sample.response.split())
        value = max(0.0, 1.0 - abs(words - self.settings.target) / self.settings.target)
        return RewardOutput(value, {"words": float(words)})


def plugin_of(**hooks: Any) -> types.SimpleNamespace:
    """A plugin object holding ``hooks`` (hook implementations or plain attributes)."""
    return types.SimpleNamespace(**hooks)


def registering(kind_hook: str, *components: Any) -> types.SimpleNamespace:
    def hook(register: Any) -> None:
        for component in components:
            register(component)

    hook.__name__ = kind_hook
    return plugin_of(**{kind_hook: miles.hookimpl(hook)})


def test_conforming_reward_plugin_passes() -> None:
    (entry,) = check_plugin(
        registering("miles_register_rewards", LengthReward), name="length_plugin", expect=[("reward", "length")]
    )
    assert entry.component is LengthReward
    values = check_reward(LengthReward)
    # responses of example_samples(): 9 words, empty, 6 words, 2 words, 5 words; target 8
    assert values == pytest.approx([1 - 1 / 8, 0.0, 1 - 2 / 8, 1 - 6 / 8, 1 - 3 / 8])
    assert check_reward(LengthReward, settings={"target": 2})[3] == 1.0


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


# -- rewards ----------------------------------------------------------------------------------------


def test_sync_score_fails() -> None:
    class Sync(Reward):
        """Synchronous by mistake."""

        name = "sync"

        def score(self, sample: Sample) -> float:  # type: ignore[override]
            return 1.0

    with pytest.raises(AssertionError, match=r"reward 'sync'.*score must be a coroutine function.*synchronous"):
        check_reward(Sync)


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ("1.0", r"must return a float or a RewardOutput, got str '1.0'"),
        (True, r"must return a float or a RewardOutput, got bool True"),
        (math.nan, r"non-finite reward nan"),
        (RewardOutput(math.inf), r"non-finite reward inf"),
        (RewardOutput(1.0, {"part": math.nan}), r"parts\['part'\] is not finite"),
        (RewardOutput(1.0, {"part": "high"}), r"parts must map str to float"),  # type: ignore[dict-item]
    ],
)
def test_bad_reward_values_fail(returned: Any, message: str) -> None:
    class Bad(Reward):
        """Returns a bad value."""

        name = "bad"

        async def score(self, sample: Sample) -> Any:
            return returned

    with pytest.raises(AssertionError, match=r"reward 'bad'.*score\(sample 0, .*" + message):
        check_reward(Bad)


def test_reward_that_raises_propagates() -> None:
    class Raises(Reward):
        """Fails on empty responses."""

        name = "raises"

        async def score(self, sample: Sample) -> float:
            return 1.0 / len(sample.response)

    with pytest.raises(ZeroDivisionError):
        check_reward(Raises)
    assert check_reward(Raises, samples=[s for s in example_samples() if s.response])[0] == pytest.approx(1 / 37)


def test_check_reward_inside_a_running_loop() -> None:
    import asyncio

    async def inside() -> list[float]:
        return check_reward(LengthReward, settings={"target": 9})

    assert asyncio.run(inside())[0] == 1.0


# -- algorithms -------------------------------------------------------------------------------------


class ClipSettings(ComponentSettings):
    """Settings of the test PPO-clip objective."""

    clip_eps: float = Field(0.2, gt=0)
    """Ratio clip range."""


class Clip(Algorithm):
    """PPO-clip with group-normalised advantages."""

    name = "clip"
    Settings = ClipSettings

    def compute_advantages(self, groups: Any, values: Any = None, **_: Any) -> list[list[torch.Tensor]]:
        out = []
        for group in groups:
            rewards = torch.tensor(group.rewards)
            std = rewards.std() if len(rewards) > 1 else torch.tensor(0.0)
            norm = (rewards - rewards.mean()) / (std + 1e-6)
            out.append([torch.full((s.response_length,), float(a)) for s, a in zip(group.samples, norm, strict=True)])
        return out

    def loss(self, inputs: LossInputs) -> LossOutput:
        assert (
            isinstance(self.settings, ClipSettings)
            and inputs.old_logprobs is not None
            and inputs.advantages is not None
        )
        ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
        eps = self.settings.clip_eps
        clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
        loss = -torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages)
        return LossOutput(loss, {"clipfrac": ((ratio - clipped).abs() > 0).float()})


def test_conforming_algorithm_passes() -> None:
    check_plugin(registering("miles_register_algorithms", Clip), name="clip_plugin")
    check_algorithm(Clip)
    check_algorithm(Clip, groups=example_groups(3, 2, seed=5), settings={"clip_eps": 0.1})


def test_algorithm_advantage_length_fails() -> None:
    class Short(Clip):
        """Advantages one token short."""

        name = "short"

        def compute_advantages(self, groups: Any, values: Any = None, **_: Any) -> list[list[torch.Tensor]]:
            return [[a[:-1] for a in row] for row in super().compute_advantages(groups)]

    with pytest.raises(
        AssertionError,
        match=r"algorithm 'short'.*group 0 sample 0 must be a tensor of shape \(\d+,\) \(its response length\)",
    ):
        check_algorithm(Short)


def test_algorithm_scalar_loss_fails() -> None:
    class Scalar(Clip):
        """Returns the mean instead of the per-token loss."""

        name = "scalar"

        def loss(self, inputs: LossInputs) -> LossOutput:
            return LossOutput(super().loss(inputs).per_token_loss.mean())

    with pytest.raises(
        AssertionError, match=r"algorithm 'scalar'.*per_token_loss must have shape \[T\] = \(\d+,\), got \(\)"
    ):
        check_algorithm(Scalar)


def test_algorithm_needs_type_fails() -> None:
    class Needy(Clip):
        """Declares its needs as a dict."""

        name = "needy"

        @property
        def needs(self) -> Any:
            return {"old_logprobs": True}

    with pytest.raises(AssertionError, match="algorithm 'needy'.*needs must be an AlgorithmNeeds, got dict"):
        check_algorithm(Needy)


def test_algorithm_detached_loss_fails() -> None:
    class Detached(Clip):
        """Forgets the graph."""

        name = "detached"

        def loss(self, inputs: LossInputs) -> LossOutput:
            return LossOutput(super().loss(inputs).per_token_loss.detach())

    with pytest.raises(AssertionError, match="algorithm 'detached'.*does not depend on the logprobs"):
        check_algorithm(Detached)


# -- transports -------------------------------------------------------------------------------------


class DirTransport(WeightTransport):
    """Reports the version without moving weights (the interface checks need no engine)."""

    name = "dir"

    async def connect(self, client: Any, dist: Any) -> None:
        self.connected = True

    async def push(self, buckets: Iterable[Any], *, version: str, dist: Any) -> PushReport:
        return PushReport(version)

    async def close(self) -> None:
        self.connected = False


def test_conforming_transport_passes(tmp_path: Path) -> None:
    check_plugin(registering("miles_register_transports", DirTransport), name="dir_plugin")
    check_transport(DirTransport, tmp_path)


def test_sync_push_fails() -> None:
    class SyncPush(DirTransport):
        """Push is synchronous by mistake."""

        name = "sync_push"

        def push(self, buckets: Iterable[Any], *, version: str, dist: Any) -> PushReport:  # type: ignore[override]
            return PushReport(version)

    with pytest.raises(AssertionError, match=r"transport 'sync_push'.*push must be a coroutine function"):
        check_transport(SyncPush)


def test_push_missing_parameter_fails() -> None:
    class NoVersion(DirTransport):
        """Push without the version."""

        name = "no_version"

        async def push(self, buckets: Iterable[Any], **kwargs: Any) -> PushReport:  # type: ignore[override]
            return PushReport("?")

    with pytest.raises(AssertionError, match=r"transport 'no_version'.*push lacks the parameter\(s\) version, dist"):
        check_transport(NoVersion)


# -- loggers ----------------------------------------------------------------------------------------


def test_logger_that_rejects_nan_fails(tmp_path: Path) -> None:
    class Strict(MetricsLogger):
        """Writes metrics as strict JSON."""

        name = "strict"

        def log(self, step: int, metrics: Mapping[str, float]) -> None:
            with open(Path(self.run_dir) / "m.json", "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, **metrics}, allow_nan=False) + "\n")

    with pytest.raises(AssertionError, match=r"logger 'strict'.*log raised ValueError: Out of range float values"):
        check_logger(Strict, tmp_path)


def test_logger_that_cannot_close_twice_fails(tmp_path: Path) -> None:
    class Once(JsonlLogger):
        """Closes once."""

        name = "once"

        def close(self) -> None:
            if self._file is None:
                raise RuntimeError("already closed")
            super().close()

    with pytest.raises(AssertionError, match=r"logger 'once'.*a second close raised RuntimeError: already closed"):
        check_logger(Once, tmp_path)


# -- data sources -----------------------------------------------------------------------------------


class LinesSource(DataSource):
    """JSONL prompts, shuffled per epoch with a seeded RNG."""

    name = "lines"

    def __init__(self, settings: BaseModel, *, path: str, seed: int, shuffle: bool, **_: Any) -> None:
        super().__init__(settings, path=path, seed=seed, shuffle=shuffle)
        with open(path, encoding="utf-8") as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.epoch, self.offset = 0, 0
        self.order = self._order()

    def _order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1000 + self.epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self.offset == len(self.order):
                self.epoch, self.offset = self.epoch + 1, 0
                self.order = self._order()
            row = self.rows[self.order[self.offset]]
            out.append(Prompt(row["prompt"], row.get("label"), source=f"{self.path}:{self.order[self.offset] + 1}"))
            self.offset += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.order = self._order()


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i}+{i}?", "label": str(2 * i)}) + "\n" for i in range(5)))
    return path


def test_conforming_data_source_passes(prompts_file: Path) -> None:
    check_plugin(registering("miles_register_data_sources", LinesSource), name="lines_plugin")
    check_data_source(LinesSource, prompts_file)


def test_data_source_that_forgets_its_rng_fails(prompts_file: Path) -> None:
    class Forgetful(LinesSource):
        """Restores the position but not the epoch."""

        name = "forgetful"

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.offset = int(state["offset"])

    with pytest.raises(AssertionError, match="data source 'forgetful'.*restored from state_dict.. does not continue"):
        check_data_source(Forgetful, prompts_file, batch=6)  # 6 of 5 rows: the state is in epoch 1


def test_unseeded_data_source_fails(prompts_file: Path) -> None:
    class Unseeded(LinesSource):
        """Shuffles with the global RNG."""

        name = "unseeded"

        def _order(self) -> list[int]:
            return random.sample(range(len(self.rows)), len(self.rows))

    random.seed(3)
    with pytest.raises(AssertionError, match="data source 'unseeded'.*different first batches"):
        check_data_source(Unseeded, prompts_file)


def test_data_source_with_unserialisable_state_fails(prompts_file: Path) -> None:
    class Opaque(LinesSource):
        """Returns a set in its state."""

        name = "opaque"

        def state_dict(self) -> dict[str, Any]:
            return {"seen": {1, 2}}

    with pytest.raises(AssertionError, match="data source 'opaque'.*state_dict is not JSON-serialisable"):
        check_data_source(Opaque, prompts_file)


# -- precision --------------------------------------------------------------------------------------


def test_precision_unknown_dtype_fails() -> None:
    class Typo(PrecisionRecipe):
        """bf16 misspelt."""

        name = "typo"
        param_dtype = "bfloat61"

    with pytest.raises(
        AssertionError, match="precision 'typo'.*param_dtype must name a torch floating dtype.*'bfloat61'"
    ):
        check_precision(Typo)


def test_precision_that_drops_weights_fails() -> None:
    class Lossy(PrecisionRecipe):
        """Skips norms."""

        name = "lossy"

        def rollout_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> Any:
            return ((n, t.to(torch.bfloat16)) for n, t in named if "norm" not in n)

    with pytest.raises(AssertionError, match="precision 'lossy'.*rollout_weights dropped weight 'model.norm.weight'"):
        check_precision(Lossy)


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
            assert len(check_reward(entry.component)) == len(example_samples())
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


# -- rollout functions ----------------------------------------------------------------------------------


async def echo_episode(client: Any, sample: Sample, sampling_params: Any) -> Sample:
    """Generates once and returns the sample."""
    (out,) = await client.generate(sample.prompt_ids, sampling_params)
    sample.response_ids = list(out.output_ids)
    return sample


def test_rollout_functions() -> None:
    check_plugin(registering_named("miles_register_rollout_functions", echo_episode, "echo"), name="echo_plugin")
    check_rollout_function(echo_episode)

    class Agent:
        """A callable object holding tools."""

        async def __call__(self, client: Any, sample: Sample, sampling_params: Any) -> Sample:
            return sample

    check_rollout_function(Agent())

    def sync_episode(client: Any, sample: Sample, sampling_params: Any) -> Sample:
        return sample

    with pytest.raises(
        AssertionError, match="rollout function 'test_rollout_functions.<locals>.sync_episode': must be a coroutine"
    ):
        check_rollout_function(sync_episode)

    async def two_args(client: Any, sample: Sample) -> Sample:
        return sample

    with pytest.raises(
        AssertionError, match=r"rollout function 'agent': must accept \(client, sample, sampling_params\)"
    ):
        check_rollout_function(two_args, name="agent")


def registering_named(kind_hook: str, component: Any, name: str) -> types.SimpleNamespace:
    def hook(register: Any) -> None:
        register(component, name=name)

    return plugin_of(**{kind_hook: miles.hookimpl(hook)})
