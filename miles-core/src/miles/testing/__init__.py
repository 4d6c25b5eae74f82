"""Test kit for Miles and its plugins: real tiny models (:mod:`miles.testing.models`, imported on
demand because it needs torch and transformers), and the conformance checks a plugin runs against
itself (:mod:`miles.testing.conformance`, :mod:`miles.testing.component_checks`), and plugins built in
a test (:mod:`miles.testing.plugins`); a local engine as a child process (:mod:`miles.testing.engine`, for
tests, benchmarks and scripts)."""

from miles.testing.component_checks import (
    check_algorithm,
    check_data_source,
    check_logger,
    check_precision,
    check_reward,
    check_rollout_function,
    check_transport,
)
from miles.testing.conformance import (
    check_component,
    check_entry_point,
    check_light_import,
    check_plugin,
    check_settings_model,
)
from miles.testing.plugins import plugin_of, registering
from miles.testing.samples import example_groups, example_samples
from miles.testing.transport_delivery import check_transport_delivery

__all__ = [
    "check_algorithm",
    "check_component",
    "check_data_source",
    "check_entry_point",
    "check_light_import",
    "check_logger",
    "check_plugin",
    "check_precision",
    "check_reward",
    "check_rollout_function",
    "check_settings_model",
    "check_transport",
    "check_transport_delivery",
    "example_groups",
    "example_samples",
    "plugin_of",
    "registering",
]
