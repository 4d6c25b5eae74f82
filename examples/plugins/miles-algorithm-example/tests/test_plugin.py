"""Tests of ``median_grpo``: conformance with Miles' algorithm interface (the kit), and the estimator's and
the term's numbers on real samples."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import miles_algorithm_example.plugin as plugin
from miles.algorithms.base import AdvantageInputs, LossInputs
from miles.testing import check_algorithm, check_light_import, check_plugin, example_groups
from miles_algorithm_example import MedianGRPO, MedianGRPOSettings


def test_plugin_conforms() -> None:
    (entry,) = check_plugin(plugin, name="algorithm_example", expect=[("algorithm", "median_grpo")])
    assert entry.component is MedianGRPO and entry.settings_model is MedianGRPOSettings


def test_plugin_module_imports_cheaply() -> None:
    check_light_import("miles_algorithm_example.plugin")


@pytest.mark.parametrize(
    "settings", [None, {"drift_coef": 0.0}, {"drift_coef": 1.0, "kl_coef": 0.05, "entropy_coef": 0.01}]
)
def test_the_algorithm_passes_the_kit(settings: dict[str, float] | None) -> None:
    """Advantages of the right shapes, a finite per-token loss whose gradient reaches the logprobs."""
    check_algorithm(MedianGRPO, settings=settings)


def test_advantages_are_rewards_minus_the_group_median_on_trained_tokens() -> None:
    groups = example_groups(num_groups=2, group_size=4, seed=3)
    advantages = MedianGRPO(MedianGRPOSettings()).compute_advantages(AdvantageInputs(groups)).advantages
    for group, row in zip(groups, advantages, strict=True):
        rewards = sorted(group.rewards)
        median = (rewards[1] + rewards[2]) / 2
        for sample, adv in zip(group.samples, row, strict=True):
            expected = torch.tensor(sample.loss_mask, dtype=torch.float32) * (sample.reward - median)
            torch.testing.assert_close(adv, expected)


def test_a_failed_sample_is_left_out_of_the_median() -> None:
    """A failed sample keeps its place with no reward and trains on nothing; the median is the others'."""
    from dataclasses import replace

    from miles.types import SampleGroup, SampleStatus

    (group,) = example_groups(num_groups=1, group_size=4, seed=3)
    rewards = [1.0, 1.0, 0.0, None]
    samples = [
        replace(
            s,
            reward=r,
            status=SampleStatus.FAILED if r is None else s.status,
            loss_mask=s.loss_mask if r is not None else [0] * len(s.loss_mask),
        )
        for s, r in zip(group.samples, rewards, strict=True)
    ]
    (row,) = MedianGRPO(MedianGRPOSettings()).compute_advantages(AdvantageInputs([SampleGroup(0, samples)])).advantages
    # the median of (1, 1, 0) is 1 (counting the failed sample as 0 it was 0.5)
    for sample, adv, expected in zip(samples, row, [0.0, 0.0, -1.0, 0.0], strict=True):
        torch.testing.assert_close(adv, torch.tensor(sample.loss_mask, dtype=torch.float32) * expected)


def test_the_drift_term_is_zero_on_policy_and_grows_with_the_ratio() -> None:
    algorithm = MedianGRPO(MedianGRPOSettings(drift_coef=0.5, clip_eps_low=10.0, clip_eps_high=10.0))
    old = torch.tensor([-1.0, -2.0, -0.5])

    def loss(shift: float) -> torch.Tensor:
        inputs = LossInputs(
            logprobs=old + shift,
            loss_mask=torch.ones(3),
            response_lengths=[3],
            advantages=torch.zeros(3),  # no surrogate: the drift term alone
            old_logprobs=old,
        )
        out = algorithm.loss(inputs)
        return out.per_token_loss

    torch.testing.assert_close(loss(0.0), torch.zeros(3))
    ratio = torch.tensor(0.1).exp()
    torch.testing.assert_close(loss(0.1), torch.full((3,), 0.5 * float((ratio - 1) ** 2)))


@pytest.mark.skipif(
    not any(ep.name == "algorithm_example" for ep in importlib.metadata.entry_points(group="miles.plugins")),
    reason="the package is not installed",
)
def test_installed_and_selected_by_name() -> None:
    from miles.plugins import PluginManager
    from miles.settings.model import PluginSpec

    manager = PluginManager().load()
    entry, options = manager.resolve("algorithm", PluginSpec(name="median_grpo", drift_coef=0.2), field="algorithm")
    assert entry.component is MedianGRPO and options.drift_coef == 0.2
