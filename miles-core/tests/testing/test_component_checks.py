"""Tests of the per-kind conformance checks: conforming components (real built-ins and small real
components written here) pass; each way of not conforming fails with a message that names it."""

from __future__ import annotations

import json
import math
import random
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, Field

import miles
import miles.metrics.jsonl
import miles.precision.builtin
from miles.algorithms.base import AdvantageInputs, Advantages, Algorithm, LossInputs, LossOutput
from miles.components import ComponentSettings
from miles.data.base import DataSource, Prompt
from miles.metrics.base import MetricsLogger
from miles.metrics.jsonl import JsonlLogger
from miles.precision.base import PrecisionRecipe
from miles.rewards.base import Reward, RewardOutput
from miles.testing import (
    check_algorithm,
    check_data_source,
    check_logger,
    check_plugin,
    check_precision,
    check_reward,
    check_rollout_function,
    check_transport,
    example_groups,
    example_samples,
)
from miles.testing.plugins import LengthReward, plugin_of, registering
from miles.transport.base import PushReport, WeightTransport
from miles.types import Sample


def test_conforming_reward_plugin_passes() -> None:
    (entry,) = check_plugin(
        registering("miles_register_rewards", LengthReward), name="length_plugin", expect=[("reward", "length")]
    )
    assert entry.component is LengthReward
    values = check_reward(LengthReward)
    # responses of example_samples(): 9 words, empty, 6 words, 2 words, 5 words; target 8
    assert values == pytest.approx([1 - 1 / 8, 0.0, 1 - 2 / 8, 1 - 6 / 8, 1 - 3 / 8])
    assert check_reward(LengthReward, settings={"target": 2})[3] == 1.0


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

    def compute_advantages(self, inputs: AdvantageInputs) -> Advantages:
        out = []
        for group in inputs.groups:
            rewards = torch.tensor(group.rewards)
            std = rewards.std() if len(rewards) > 1 else torch.tensor(0.0)
            norm = (rewards - rewards.mean()) / (std + 1e-6)
            out.append([torch.full((s.response_length,), float(a)) for s, a in zip(group.samples, norm, strict=True)])
        return Advantages(out)

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

        def compute_advantages(self, inputs: AdvantageInputs) -> Advantages:
            return Advantages([[a[:-1] for a in row] for row in super().compute_advantages(inputs).advantages])

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
