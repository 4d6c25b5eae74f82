"""The built-in plugins: ordinary plugin modules, registered through the same hooks as third-party
ones and blockable by name (``MILES_DISABLE_PLUGINS=jsonl``)."""

from __future__ import annotations

BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("precision", "miles.precision.builtin"),
    ("quantized_precision", "miles.precision.quantized"),
    ("jsonl", "miles.metrics.jsonl"),
    ("tensorboard", "miles.metrics.tensorboard"),
    ("wandb", "miles.metrics.wandb"),
    ("transports", "miles.transport.plugin"),
    ("local_engine", "miles.engine.plugin"),
    ("algorithms", "miles.algorithms.plugin"),
    ("rewards", "miles.rewards.plugin"),
    ("data", "miles.data.plugin"),
    ("launch", "miles.launch.plugin"),
)
"""``(plugin name, module)`` pairs, in registration order."""
