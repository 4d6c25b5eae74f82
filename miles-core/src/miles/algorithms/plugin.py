"""The built-in algorithms plugin: registers every RL objective that ships with miles-core.

Importing this module is cheap (no torch): the algorithm modules import torch inside their functions.
"""

from __future__ import annotations

from miles.components import Register
from miles.markers import hookimpl


@hookimpl
def miles_register_algorithms(register: Register) -> None:
    from miles.algorithms.builtin import ALGORITHMS

    for cls in ALGORITHMS:
        register(cls)
